"""The shared helpers in `speechattn.utils`."""

import os

import pytest
import torch

from speechattn.utils import (
    IGNORE_INDEX,
    TEMP_MARK,
    atomic_path,
    atomic_write_text,
    choose_device,
    lengths_to_padding_mask,
    track,
)


def test_padding_mask_marks_frames_past_each_length():
    mask = lengths_to_padding_mask(torch.tensor([3, 1, 0]), 4)
    assert mask.tolist() == [
        [False, False, False, True],
        [False, True, True, True],
        [True, True, True, True],
    ]
    assert lengths_to_padding_mask(torch.tensor([2, 5])).shape == (2, 5)  # longest by default


def test_ignore_index_is_cross_entropys_default():
    assert IGNORE_INDEX == torch.nn.CrossEntropyLoss().ignore_index


def test_choose_device():
    assert choose_device("cpu") == torch.device("cpu")
    assert choose_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_atomic_write_replaces_whole_files_and_leaves_no_temporary_on_failure(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"
    assert os.listdir(path.parent) == ["a.json"]
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and not list(path.parent.glob(f"*{TEMP_MARK}*"))
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # a normal file, not mkstemp's 0600


def test_track_yields_every_item_with_and_without_a_bar():
    assert list(track(range(3), "x", enabled=False)) == [0, 1, 2]
    assert list(track(iter("ab"), "x", total=2)) == ["a", "b"]


def test_digest_is_canonical_json_then_lines():
    import hashlib
    import json

    from speechattn.utils import digest

    assert digest({"b": 1, "a": [2]}) == digest({"a": [2], "b": 1})
    expected = hashlib.sha256(json.dumps({"a": 1}).encode())
    expected.update(b"x\n")
    assert digest({"a": 1}, ["x\n"], length=20) == expected.hexdigest()[:20]


@pytest.mark.slow
def test_a_pool_ends_while_the_training_stop_handler_is_installed():
    """Forked pool workers inherit the parent's signal handlers; the training's stop handler
    only sets a flag, so without `init_pool_worker` resetting it `Pool.terminate()` (SIGTERM)
    never ended them and leaving the pool hung (the first extraction of a CLI run)."""
    import subprocess
    import sys

    script = (
        "import signal\n"
        "from speechattn.data.cache.shards import map_in_processes\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\n"  # what StopOnSignal installs
        "import time\n"
        "it = map_in_processes(time.sleep, [0, 600, 600, 600], 2)\n"
        "print(next(it))\n"
        "it.close()\n"  # leave the pool early (an error): terminate() a busy worker
        "print('done')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "done"]

"""A full device while speechattn writes a file ends in one `DiskFullError` naming the file, the
free space in its folder and the fix -- for every file written through `utils.atomic_path`:
upstream.pt, a downstream `<split>.pt`, Lightning's checkpoints, the feature cache's files --
instead of a bare `[Errno 28]` or torch's `inline_container.cc ... unexpected pos`. No
temporary file stays behind, and the previous version of the file is untouched.

The device is simulated: torch really writes, into a sink whose `write` fails with ENOSPC
after a few bytes (torch then raises exactly what it raises on a full disk); Python writes
fail with the OSError a full disk gives."""

from __future__ import annotations

import errno
import io
import pickle
from pathlib import Path

import pytest
import torch

from speechattn.errors import DiskFullError, SpeechattnError
from speechattn.utils import TEMP_MARK, atomic_write_text

REAL_SAVE = torch.save


class _FullDevice(io.RawIOBase):
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, room: int = 512) -> None:
        self.room = room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.room -= len(data)
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)


@pytest.fixture
def full_disk_for_torch(monkeypatch):
    """`torch.save` into a full device, whatever the target (path or file)."""
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: REAL_SAVE(obj, _FullDevice()))


def _assert_names(error: DiskFullError, path: Path) -> None:
    message = str(error)
    assert isinstance(error, SpeechattnError) and error.errno == errno.ENOSPC
    assert message.startswith(f"{path}: cannot be written: the device is full")
    assert f"MiB free in {path.parent}" in message and "free space there" in message
    assert "inline_container" not in message
    assert not list(path.parent.glob(f"*{TEMP_MARK}*")), "a failed write leaves no temporary"


def test_real_torch_save_into_a_full_device_says_unexpected_pos():
    """What the fixture simulates is what torch does (so the translation is tested on it)."""
    with pytest.raises(RuntimeError, match="inline_container.*unexpected pos"):
        REAL_SAVE({"w": torch.zeros(1000)}, _FullDevice())


def test_upstream_pt(tmp_path, full_disk_for_torch):
    from speechattn.model.upstream import save_upstream

    path = tmp_path / "run" / "upstream.pt"
    state = {"state_dict": {"w": torch.zeros(1000)}, "normalizer": {}}
    with pytest.raises(DiskFullError) as info:
        save_upstream(path, state)
    _assert_names(info.value, path)
    assert not path.exists()


def test_downstream_split_features(tmp_path, full_disk_for_torch):
    from speechattn.tasks.downstream.features import SplitFeatures, save_split

    split = SplitFeatures(
        ["a"], torch.zeros(4, 2, 3, dtype=torch.float16), torch.tensor([4]), torch.tensor([8])
    )
    path = tmp_path / "features" / "train.pt"
    path.parent.mkdir()
    path.write_bytes(b"previous")
    with pytest.raises(DiskFullError) as info:
        save_split(split, path)
    _assert_names(info.value, path)
    assert path.read_bytes() == b"previous"


def test_lightning_checkpoint_is_written_beside_its_target_not_in_tmpdir(
    tmp_path, monkeypatch, full_disk_for_torch
):
    """Lightning's own writer stages checkpoints in $TMPDIR (a full one gave `[Errno 28]` with
    no path); the trainer's checkpoint IO writes beside the target instead."""
    import tempfile

    from speechattn.tasks.preemption import AtomicCheckpointIO

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmpdir"))
    path = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(DiskFullError) as info:
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(1000)}}, path)
    _assert_names(info.value, path)
    monkeypatch.setattr(torch, "save", REAL_SAVE)
    AtomicCheckpointIO().save_checkpoint({"step": 3}, path)
    assert torch.load(path, weights_only=True) == {"step": 3}


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
    ],
)
def test_text_files(tmp_path, monkeypatch, error):
    def full(self, data):
        raise error

    monkeypatch.setattr(Path, "write_bytes", full)
    path = tmp_path / "settings.json"
    with pytest.raises(DiskFullError) as info:
        atomic_write_text(path, "{}")
    assert info.value.errno == error.errno and error.strerror in str(info.value)
    assert str(path) in str(info.value) and not list(tmp_path.iterdir())


def test_in_tmpdir_the_fix_is_to_set_tmpdir(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(Path, "write_bytes", lambda self, data: _FullDevice(0).write(data))
    with pytest.raises(DiskFullError, match="set TMPDIR to a folder on a larger disk"):
        atomic_write_text(tmp_path / "x.json", "{}")


def test_other_errors_pass_through(tmp_path, monkeypatch):
    def denied(self, data):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "write_bytes", denied)
    with pytest.raises(PermissionError):
        atomic_write_text(tmp_path / "x.json", "{}")


def test_the_error_crosses_process_boundaries():
    error = pickle.loads(pickle.dumps(DiskFullError("/x/y.npy: cannot be written", errno.EDQUOT)))
    assert str(error) == "/x/y.npy: cannot be written" and error.errno == errno.EDQUOT

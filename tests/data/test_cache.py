"""Feature cache: correctness, atomicity, resume after an interruption, parallel extraction.

(Identity across edits and moves: test_cache_identity.py; descriptors: test_cache_descriptors.py;
ls/gc: test_cache_gc.py; damaged files: test_cache_integrity.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from speechattn.data.cache import (
    OPEN_SHARDS,
    ExtractionSettings,
    FeatureStore,
    extract_features,
    plan_shards,
    shard_dir,
)
from speechattn.data.features import LogMel
from speechattn.data.librispeech import scan_split

SETTINGS = ExtractionSettings(dtype="float32")


@pytest.fixture(scope="module")
def utts(tiny_corpus):
    return scan_split(tiny_corpus, "synth-clean")


def _shards(cache: Path, settings: ExtractionSettings = SETTINGS) -> Path:
    return shard_dir(cache, settings)


def _plan(utts, shard_size: int) -> list[tuple[int, int]]:
    return plan_shards([u.utt_id for u in utts], shard_size)


def _all_features(store: FeatureStore) -> dict[str, np.ndarray]:
    return {u: store.features(u) for u in store.utt_ids}


def test_cached_features_equal_direct_extraction(utts, tmp_path):
    store = extract_features(utts, SETTINGS, tmp_path, shard_size=5, workers=1, progress=False)
    assert store.utt_ids == [u.utt_id for u in utts] and len(store) == 24
    mel = LogMel()
    for u in utts[:4]:
        audio, _ = sf.read(str(u.path), dtype="float32")
        np.testing.assert_array_equal(store.features(u.utt_id), mel(audio).numpy())
    assert store.audio_seconds == pytest.approx(
        sum(sf.info(str(u.path)).duration for u in utts), rel=1e-6
    )
    files = sorted(p.name for p in _shards(tmp_path).iterdir() if p.name != "settings.json")
    n_shards = len(_plan(utts, 5))
    assert store.num_shards == n_shards and 1 < n_shards < 24
    for suffix in (".npy", ".stats.npy", ".json"):  # features, statistics, commit marker
        assert (
            sum(f.endswith(suffix) and f.count(".") == suffix.count(".") for f in files) == n_shards
        )
    (manifest,) = (tmp_path / "features" / "splits").glob("*.json")
    assert manifest == store.manifest and manifest.with_suffix(".npz").is_file()
    assert not [f for f in (tmp_path / "features").rglob("*.tmp-*")]


def test_shards_are_content_defined_and_capped():
    ids = [f"{s}-{c}-{i:04d}" for s in range(1000, 1040) for c in (1, 2) for i in range(30)]
    plan = plan_shards(ids, 16)
    assert [a for a, _ in plan[1:]] == [b for _, b in plan[:-1]] and plan[-1][1] == len(ids)
    sizes = [b - a for a, b in plan]
    assert max(sizes) <= 48 and 10 < len(ids) / len(plan) < 26  # mean near shard_size
    # removing one id moves no boundary but (at most) the one after it
    gone = ids[:700] + ids[701:]
    ends = {ids[b - 1] for _, b in plan}
    assert len(ends ^ {gone[b - 1] for _, b in plan_shards(gone, 16)}) <= 2


def test_float16_cache_and_statistics(utts, tmp_path):
    store = extract_features(
        utts, ExtractionSettings(), tmp_path, shard_size=7, workers=1, progress=False
    )
    assert store.raw(0).dtype == np.float16
    x = np.concatenate([store.features(i) for i in range(len(store))]).astype(np.float64)
    count, total, total_sq = store.sums(range(len(store)))
    assert count == len(x)
    np.testing.assert_allclose(total, x.sum(0), rtol=1e-9)
    np.testing.assert_allclose(total_sq, (x**2).sum(0), rtol=1e-9)


class Interrupt(Exception):
    pass


def test_interrupted_extraction_resumes_to_an_identical_cache(utts, tmp_path):
    reference = _all_features(
        extract_features(utts, SETTINGS, tmp_path / "ref", shard_size=5, workers=1, progress=False)
    )
    n_shards = len(_plan(utts, 5))

    def stop_after_two(shard: int) -> None:
        if shard == 1:
            raise Interrupt

    with pytest.raises(Interrupt):
        extract_features(
            utts,
            SETTINGS,
            tmp_path / "c",
            shard_size=5,
            workers=1,
            progress=False,
            on_shard_done=stop_after_two,
        )
    shards = _shards(tmp_path / "c")
    splits = tmp_path / "c" / "features" / "splits"
    (plan,) = splits.glob("*.plan.json")  # an incomplete folder has a plan, never a manifest
    assert not [p for p in splits.glob("*.json") if p != plan]
    keys = json.loads(plan.read_text())["shards"]
    assert len(keys) == n_shards
    assert sorted(p.name for p in shards.glob("*.json") if p.name != "settings.json") == sorted(
        f"{k}.json" for k in keys[:2]
    )
    # debris of a writer killed mid-file: a stray temp file and a shard without its commit marker
    (shards / f"{keys[2]}.npy.tmp-{2**22 + 17}-abcdef").write_bytes(b"half a file")
    (shards / f"{keys[3]}.npy").write_bytes(b"garbage from a killed writer")
    done_before = (shards / f"{keys[0]}.npy").stat().st_mtime_ns

    redone = []
    store = extract_features(
        utts,
        SETTINGS,
        tmp_path / "c",
        shard_size=5,
        workers=1,
        progress=False,
        on_shard_done=redone.append,
    )
    assert sorted(redone) == list(range(2, n_shards))  # done shards are skipped
    assert (shards / f"{keys[0]}.npy").stat().st_mtime_ns == done_before
    assert not list(shards.glob("*.tmp-*")) and not list(splits.glob("*.plan.json"))
    resumed = _all_features(store)
    assert resumed.keys() == reference.keys()
    for u in reference:
        np.testing.assert_array_equal(resumed[u], reference[u])


KILL_SCRIPT = """
import os, signal, sys
from speechattn.data.cache import ExtractionSettings, extract_features
from speechattn.data.librispeech import scan_split
utts = scan_split(sys.argv[1], "synth-clean")
def kill(shard):
    if shard == 2:
        os.kill(os.getpid(), signal.SIGKILL)
extract_features(utts, ExtractionSettings(dtype="float32"), sys.argv[2], shard_size=4, workers=1,
                 progress=False, on_shard_done=kill)
"""


def test_sigkill_mid_extraction_then_rerun(utts, tiny_corpus, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(tiny_corpus), str(tmp_path)],
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    n_shards = len(_plan(utts, 4))
    markers = [p for p in _shards(tmp_path).glob("*.json") if p.name != "settings.json"]
    assert len(markers) == 3 and not list((tmp_path / "features" / "splits").glob("*[0-9a-f].json"))
    redone = []
    store = extract_features(
        utts,
        SETTINGS,
        tmp_path,
        shard_size=4,
        workers=1,
        progress=False,
        on_shard_done=redone.append,
    )
    assert sorted(redone) == list(range(3, n_shards))
    mel = LogMel()
    for u in utts[::5]:
        audio, _ = sf.read(str(u.path), dtype="float32")
        np.testing.assert_array_equal(store.features(u.utt_id), mel(audio).numpy())


def test_parallel_extraction_matches_serial(utts, tmp_path):
    serial = extract_features(
        utts, SETTINGS, tmp_path / "a", shard_size=6, workers=1, progress=False
    )
    parallel = extract_features(
        utts, SETTINGS, tmp_path / "b", shard_size=6, workers=2, progress=True
    )
    assert serial.utt_ids == parallel.utt_ids
    for u in serial.utt_ids:
        np.testing.assert_array_equal(serial.features(u), parallel.features(u))


def test_store_pickles_without_open_files(utts, tmp_path):
    import pickle

    store = extract_features(utts, SETTINGS, tmp_path, shard_size=8, workers=1, progress=False)
    store.features(0)
    assert str(store.paths(int(store.shard[0])).npy) in OPEN_SHARDS.files
    assert store.position[store.utt_ids[3]] == 3
    clone = pickle.loads(pickle.dumps(store))
    assert "position" not in clone.__dict__  # rebuilt on demand in each worker
    assert np.array_equal(clone.features(3), store.features(3)) and clone.utt_ids == store.utt_ids
    meta = json.loads(store.manifest.read_text())
    assert meta["shards"] == store.shard_keys and meta["settings"]["dtype"] == "float32"
    assert (
        meta["folder"] == str(utts[0].path.parents[2])
        and os.path.getsize(store.manifest.with_suffix(".npz")) == meta["npz"]["size"]
    )


def test_a_killed_extraction_worker_ends_the_run_promptly_and_a_rerun_finishes(utts, tmp_path):
    """SIGKILL to one of two pool workers once a shard is committed (the out-of-memory
    killer): the extraction ends with an error naming what happened instead of waiting
    forever, leaves no claim behind, and a second run extracts only what is missing."""
    import multiprocessing as mp
    import time

    from speechattn.data.claims import WorkerDied

    killed: list[int] = []

    def kill_a_worker(index: int) -> None:
        # once: a result already queued when the pool broke calls this again, and the worker
        # killed the first time may be reaped by the pool's manager thread by then
        workers = mp.active_children()
        if workers and not killed:
            killed.append(workers[0].pid)
            os.kill(workers[0].pid, signal.SIGKILL)

    start = time.monotonic()
    with pytest.raises(WorkerDied, match="a worker process died"):
        extract_features(utts, SETTINGS, tmp_path, shard_size=4, workers=2, progress=False,
                         on_shard_done=kill_a_worker)  # fmt: skip
    assert time.monotonic() - start < 60
    assert not list(_shards(tmp_path).glob("*.claim"))
    redone = []
    store = extract_features(utts, SETTINGS, tmp_path, shard_size=4, workers=1, progress=False,
                             on_shard_done=redone.append)  # fmt: skip
    assert 0 < len(redone) < len(_plan(utts, 4)) and len(store.utt_ids) == len(utts)


def test_a_worker_that_wakes_after_its_shard_was_taken_over_uses_the_other_commit(
    utts, tmp_path, monkeypatch, caplog
):
    """A worker stopped past the claims' expiry while writing: another process took the shard
    over, removed the sleeper's temporary file and committed. The sleeper, woken, finds its
    temporary file gone (or the commit there) and takes that commit, instead of crashing."""
    import logging

    from speechattn.data.cache import shards as shards_module

    directory = _shards(tmp_path)
    directory.mkdir(parents=True)
    task = shards_module.ShardTask(
        directory, "k" * 16, [(u.utt_id, str(u.path), None) for u in utts[:3]], SETTINGS, 3
    )
    real_save = shards_module.save_npy

    def taken_over_meanwhile(path, array):
        if not (directory / f"{task.key}.json").exists():
            monkeypatch.setattr(shards_module, "save_npy", real_save)
            shards_module.extract_shard(task)  # the other process, start to commit
        raise FileNotFoundError(2, "No such file or directory", str(path) + ".tmp-1-abc")

    monkeypatch.setattr(shards_module, "save_npy", taken_over_meanwhile)
    committed_by_other = None
    with caplog.at_level(logging.WARNING):
        result = shards_module.extract_shard(task)
        committed_by_other = shards_module.read_marker(directory / f"{task.key}.json")
        again = shards_module.extract_shard(task)  # woken before writing: the commit is there
    assert result == committed_by_other == again
    assert "was finished by another process while this one was stopped" in caplog.text

"""Feature cache: correctness, keys, atomicity, resume after an interruption, parallel extraction."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from speechattn.data.cache import ExtractionSettings, FeatureStore, cache_key, extract_features
from speechattn.data.features import FeatureConfig, LogMel
from speechattn.data.librispeech import scan_split

SETTINGS = ExtractionSettings(dtype="float32")


@pytest.fixture(scope="module")
def utts(tiny_corpus):
    return scan_split(tiny_corpus, "synth-clean")


def _entry(cache: Path) -> Path:
    (entry,) = (cache / "features").iterdir()
    return entry


def _all_features(store: FeatureStore) -> dict[str, np.ndarray]:
    return {u: store.features(u) for u in store.utt_ids}


def test_cached_features_equal_direct_extraction(utts, tmp_path):
    store = extract_features(utts, SETTINGS, tmp_path, shard_size=5, workers=1, progress=False)
    assert store.utt_ids == [u.utt_id for u in utts] and len(store) == 24
    mel = LogMel()
    for u in utts[:4]:
        audio, _ = sf.read(str(u.path), dtype="float32")
        np.testing.assert_array_equal(store.features(u.utt_id), mel(audio).numpy())
    assert isinstance(store._shard(0), np.memmap)  # loading is a memory-mapped slice
    assert store.audio_seconds == pytest.approx(
        sum(sf.info(str(u.path)).duration for u in utts), rel=1e-6
    )
    files = sorted(p.name for p in _entry(tmp_path).iterdir())
    assert (
        "index.npz" in files and sum(f.endswith(".stats.npy") for f in files) == 5
    )  # ceil(24 / 5) shards
    assert not [f for f in files if ".tmp-" in f]


def test_float16_cache_and_statistics(utts, tmp_path):
    store = extract_features(
        utts, ExtractionSettings(), tmp_path, shard_size=7, workers=1, progress=False
    )
    assert store._shard(0).dtype == np.float16
    x = np.concatenate([store.features(i) for i in range(len(store))]).astype(np.float64)
    count, total, total_sq = store.sums(range(len(store)))
    assert count == len(x)
    np.testing.assert_allclose(total, x.sum(0), rtol=1e-9)
    np.testing.assert_allclose(total_sq, (x**2).sum(0), rtol=1e-9)


def test_key_depends_on_settings_and_files(utts):
    key = cache_key(utts, SETTINGS)
    assert key == cache_key(list(utts), SETTINGS)
    assert key != cache_key(utts[:-1], SETTINGS)
    assert key != cache_key(
        utts, dataclasses.replace(SETTINGS, features=FeatureConfig(deltas=True))
    )
    assert key != cache_key(utts, dataclasses.replace(SETTINGS, dtype="float16"))
    touched = [dataclasses.replace(utts[0], mtime_ns=utts[0].mtime_ns + 1), *utts[1:]]
    assert key != cache_key(touched, SETTINGS)


class Interrupt(Exception):
    pass


def test_interrupted_extraction_resumes_to_an_identical_cache(utts, tmp_path):
    reference = _all_features(
        extract_features(utts, SETTINGS, tmp_path / "ref", shard_size=5, workers=1, progress=False)
    )

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
    entry = _entry(tmp_path / "c")
    assert not (entry / "index.npz").exists()  # an incomplete entry is never loadable
    assert sorted(p.name for p in entry.glob("shard-*.json")) == [
        "shard-00000.json",
        "shard-00001.json",
    ]
    # debris of a writer killed mid-file: a stray temp file and a shard without its commit marker
    (entry / f"shard-00002.npy.tmp-{2**22 + 17}-abcdef").write_bytes(b"half a file")
    (entry / "shard-00003.npy").write_bytes(b"garbage from a killed writer")
    done_before = (entry / "shard-00000.npy").stat().st_mtime_ns

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
    assert sorted(redone) == [2, 3, 4]  # done shards are skipped
    assert (entry / "shard-00000.npy").stat().st_mtime_ns == done_before
    assert not list(entry.glob("*.tmp-*"))
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
    entry = _entry(tmp_path)
    assert not (entry / "index.npz").exists() and len(list(entry.glob("shard-*.json"))) == 3
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
    assert sorted(redone) == [3, 4, 5]
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


def test_store_pickles_without_memory_maps(utts, tmp_path):
    import pickle

    store = extract_features(utts, SETTINGS, tmp_path, shard_size=8, workers=1, progress=False)
    store.features(0)
    clone = pickle.loads(pickle.dumps(store))
    assert clone._maps == {} and np.array_equal(clone.features(3), store.features(3))
    meta = json.loads((store.directory / "settings.json").read_text())
    assert meta["shards"] == 3 and meta["dtype"] == "float32"
    assert os.path.getsize(store.directory / "index.npz") > 0

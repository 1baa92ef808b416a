"""A damaged feature cache is never served: flipped bytes, damaged headers, truncated shards and
corrupt statistics are found (size and mtime against the record at start-up, then a checksum;
header and size whenever a process opens a shard; every checksum with verify), named, and
re-extracted; a full disk says so, with the cache path and the space needed."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from speechattn.data import DataError, PretrainDataModule
from speechattn.data.cache import (
    OPEN_SHARDS,
    ExtractionSettings,
    FeatureStore,
    extract_features,
    open_split,
)
from speechattn.data.cache import shards as shards_module
from speechattn.data.librispeech import scan_split

SETTINGS = ExtractionSettings()  # float16, as the data modules store features


@pytest.fixture(scope="module")
def utts(tiny_corpus):
    return scan_split(tiny_corpus, "synth-clean")


def _extract(utts, cache: Path, **kw) -> FeatureStore:
    return extract_features(utts, SETTINGS, cache, shard_size=5, workers=1, progress=False, **kw)


def _flip(path: Path, offset: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + n] = bytes(b ^ 0xFF for b in data[offset : offset + n])
    time.sleep(0.02)  # damage comes later than the write (mtimes tick every few ms)
    path.write_bytes(bytes(data))


def _damage(case: str, store: FeatureStore) -> Path:
    """Damage one file of shard 1 as `case` says; returns it."""
    shard, stats = store.paths(1).npy, store.paths(1).stats
    if case == "data_bytes":
        _flip(shard, shard.stat().st_size // 2)
        return shard
    if case == "stats_bytes":
        _flip(stats, stats.stat().st_size - 40)
        return stats
    if case == "header":  # what gave tokenize.TokenError mid-training
        _flip(shard, 20, 8)
        return shard
    if case == "truncated":  # what gave "mmap length is greater than file size"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return shard
    if case == "data_bytes_same_mtime":  # bit rot: size and mtime as recorded
        before = shard.stat()
        _flip(shard, shard.stat().st_size // 2)
        os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
        return shard
    raise ValueError(case)


def _first_of_shard(store: FeatureStore, k: int) -> str:
    return store.utt_ids[int((store.shard == k).argmax())]


def _reference(store: FeatureStore) -> tuple[dict[str, np.ndarray], np.ndarray]:
    feats = {u: store.features(u) for u in store.utt_ids}
    return feats, store.sums(range(len(store)))[1]


def _assert_serves(store: FeatureStore, reference) -> None:
    feats, sums = reference
    assert store.utt_ids == list(feats)
    for u, x in feats.items():
        np.testing.assert_array_equal(store.features(u), x)
    np.testing.assert_array_equal(store.sums(range(len(store)))[1], sums)


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("case", ["stats_bytes", "header", "truncated", "data_bytes"])
def test_damaged_cache_files_are_named_and_reextracted(utts, tmp_path, caplog, case, verify):
    store = _extract(utts, tmp_path)
    reference = _reference(store)
    damaged = _damage(case, store)
    with caplog.at_level(logging.WARNING):  # size or mtime moved: checksummed, refused
        store = _extract(utts, tmp_path, verify=verify)
    assert f"{damaged}: " in caplog.text and "re-extracting its shard" in caplog.text
    _assert_serves(store, reference)


def test_bit_rot_under_the_recorded_size_and_mtime_is_found_by_verify(utts, tmp_path, caplog):
    store = _extract(utts, tmp_path)
    reference = _reference(store)
    damaged = _damage("data_bytes_same_mtime", store)
    with caplog.at_level(logging.WARNING):
        store = _extract(utts, tmp_path, verify=True)
    assert f"{damaged}: checksum mismatch" in caplog.text
    _assert_serves(store, reference)


def test_damage_after_start_up_is_refused_on_first_read(utts, tmp_path):
    store = _extract(utts, tmp_path)
    reference = _reference(store)
    fresh = FeatureStore(store.manifest)  # as a DataLoader worker sees it: shard 1 not opened yet
    OPEN_SHARDS.forget(str(store.paths(1).npy))
    damaged = _damage("data_bytes", store)
    with pytest.raises(DataError, match="checksum mismatch") as info:
        fresh.features(_first_of_shard(fresh, 1))
    assert str(damaged) in str(info.value) and "rerun the same command" in str(info.value)
    assert not store.paths(1).marker.exists()  # marked for re-extraction
    _assert_serves(_extract(utts, tmp_path), reference)  # ... which the rerun does


def test_a_touched_shard_is_checksummed_once_and_kept(utts, tiny_corpus, tmp_path, monkeypatch):
    """A copy or `touch` moves the mtime: the bytes are checked once, then trusted again."""
    store = open_split(tiny_corpus, "synth-clean", SETTINGS, tmp_path, progress=False)
    reference = _reference(store)
    hashed = []
    original = shards_module.file_sha256
    monkeypatch.setattr(shards_module, "file_sha256", lambda p: hashed.append(p) or original(p))
    again = open_split(tiny_corpus, "synth-clean", SETTINGS, tmp_path, progress=False)
    _assert_serves(again, reference)
    assert hashed == []  # size + mtime as recorded: no checksum at start-up or on reads
    os.utime(store.paths(0).npy, ns=(1, 10**18))
    again = open_split(tiny_corpus, "synth-clean", SETTINGS, tmp_path, progress=False)
    assert hashed == [store.paths(0).npy]
    again = open_split(tiny_corpus, "synth-clean", SETTINGS, tmp_path, progress=False)
    _assert_serves(again, reference)
    assert hashed == [store.paths(0).npy] and again.manifest == store.manifest


def test_corrupt_statistics_never_reach_the_normaliser(tiny_data_config, tmp_path):
    """Flipped bytes in shard.stats.npy used to corrupt the normaliser (loss 25992, exit 0)."""
    cfg = dataclasses.replace(tiny_data_config, cache_dir=str(tmp_path))
    first = PretrainDataModule(cfg)
    first.setup("fit")
    stats_files = list((tmp_path / "features" / "shards").glob("*/*.stats.npy"))
    assert stats_files
    for stats in stats_files:
        _flip(stats, stats.stat().st_size - 64, 32)
    again = PretrainDataModule(cfg)
    again.setup("fit")
    torch.testing.assert_close(again.normalizer.mean, first.normalizer.mean, rtol=0, atol=0)
    torch.testing.assert_close(again.normalizer.std, first.normalizer.std, rtol=0, atol=0)


def test_an_unreadable_manifest_is_rebuilt(utts, tiny_corpus, tmp_path, caplog):
    store = open_split(tiny_corpus, "synth-clean", SETTINGS, tmp_path, progress=False)
    reference = _reference(store)
    store.manifest.with_suffix(".npz").write_bytes(b"not a zip")
    with caplog.at_level(logging.WARNING):
        again = open_split(tiny_corpus, "synth-clean", SETTINGS, tmp_path, progress=False)
    assert "unreadable feature cache manifest" in caplog.text and str(store.manifest) in caplog.text
    _assert_serves(again, reference)
    store.manifest.write_text("{")
    _assert_serves(_extract(utts, tmp_path), reference)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError("105440 requested and 24512 written"),
    ],
)
def test_full_disk_names_the_cache_and_the_space_needed(utts, tmp_path, monkeypatch, error):
    original = shards_module._HashingWriter.write
    written = []

    def write(self, data):
        name = Path(self.f.name).name.split(".")[0]
        if name not in written:
            written.append(name)
        if len(written) == 3:  # two shards fit, then the device is full
            raise error
        return original(self, data)

    monkeypatch.setattr(shards_module._HashingWriter, "write", write)
    with pytest.raises(DataError, match="feature cache device is full") as info:
        _extract(utts, tmp_path)
    directory = next((tmp_path / "features" / "shards").iterdir())
    message = str(info.value)
    assert str(directory) in message and "needs about" in message and "data.cache_dir" in message
    assert not list(directory.glob("*.tmp-*")), "a failed write leaves no temporary file"
    done = sorted(p.name for p in directory.glob("*.json") if p.name != "settings.json")
    assert done == sorted(f"{key}.json" for key in written[:2])
    assert not list((tmp_path / "features" / "splits").glob("*[0-9a-f].json"))  # no manifest
    monkeypatch.setattr(shards_module._HashingWriter, "write", original)
    _assert_serves(_extract(utts, tmp_path), _reference(_extract(utts, tmp_path / "clean")))


def test_nan_written_under_the_recorded_size_and_mtime_is_named_when_read(utts, tmp_path):
    """NaN planted in a shard with its size and mtime kept passes the start-up stat; reading
    the utterance refuses it, naming the file and the utterance, instead of a diverged run
    that blames the learning rate."""
    store = _extract(utts, tmp_path)
    utt = _first_of_shard(store, 1)
    shard = store.paths(1).npy
    before = shard.stat()
    with shard.open("rb") as f:  # where the array's data starts, past the .npy header
        assert np.lib.format.read_magic(f) == (1, 0)
        np.lib.format.read_array_header_1_0(f)
        header = f.tell()
    data = bytearray(shard.read_bytes())
    nan16 = np.array([np.nan], dtype=np.float16).tobytes()
    data[header : header + 2] = nan16  # the shard's first value: its first utterance's
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    fresh = FeatureStore(store.manifest)
    OPEN_SHARDS.forget(str(shard))
    with pytest.raises(DataError, match=rf"utterance {utt} holds NaN or inf values") as info:
        fresh.features(utt)
    assert str(shard) in str(info.value) and not store.paths(1).marker.exists()

"""A damaged feature cache is never served: flipped bytes, damaged headers, truncated shards and
corrupt statistics are found (size and header at open, checksums at open or on first read),
named, and re-extracted; a full disk says so, with the cache path and the space needed."""

from __future__ import annotations

import dataclasses
import errno
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from speechattn.data import DataError, PretrainDataModule
from speechattn.data import cache as cache_module
from speechattn.data.cache import ExtractionSettings, FeatureStore, extract_features
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
    path.write_bytes(bytes(data))


def _damage(case: str, entry: Path) -> Path:
    """Damage one file of shard 1 as `case` says; returns it."""
    shard, stats = entry / "shard-00001.npy", entry / "shard-00001.stats.npy"
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
    raise ValueError(case)


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
    reference = _reference(_extract(utts, tmp_path))
    (entry,) = (tmp_path / "features").iterdir()
    damaged = _damage(case, entry)
    cache_module._VERIFIED.clear()  # a new process: nothing checksummed yet
    victim = utts[5].utt_id  # first utterance of shard 1
    with caplog.at_level(logging.WARNING):
        store = _extract(utts, tmp_path, verify=verify)
    if case == "data_bytes" and not verify:
        # same size and header: found by the checksum on the shard's first read
        with pytest.raises(DataError, match="checksum mismatch") as info:
            store.features(victim)
        assert str(damaged) in str(info.value) and "rerun the same command" in str(info.value)
        store = _extract(utts, tmp_path)  # ... which re-extracts it
    else:
        assert f"{damaged}: " in caplog.text and "re-extracting shard 1" in caplog.text
    _assert_serves(store, reference)


def test_corrupt_statistics_never_reach_the_normaliser(tiny_data_config, tmp_path):
    """Flipped bytes in shard.stats.npy used to corrupt the normaliser (loss 25992, exit 0)."""
    cfg = dataclasses.replace(tiny_data_config, cache_dir=str(tmp_path))
    first = PretrainDataModule(cfg)
    first.setup("fit")
    for stats in (tmp_path / "features").glob("*/shard-00000.stats.npy"):
        _flip(stats, stats.stat().st_size - 64, 32)
    again = PretrainDataModule(cfg)
    again.setup("fit")
    torch.testing.assert_close(again.normalizer.mean, first.normalizer.mean, rtol=0, atol=0)
    torch.testing.assert_close(again.normalizer.std, first.normalizer.std, rtol=0, atol=0)


def test_an_unreadable_index_is_rebuilt(utts, tmp_path):
    reference = _reference(_extract(utts, tmp_path))
    (entry,) = (tmp_path / "features").iterdir()
    (entry / "index.npz").write_bytes(b"not a zip")
    _assert_serves(_extract(utts, tmp_path), reference)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError("105440 requested and 24512 written"),
    ],
)
def test_full_disk_names_the_cache_and_the_space_needed(utts, tmp_path, monkeypatch, error):
    original = cache_module._HashingWriter.write

    def write(self, data):
        if "shard-00002.npy" in self.f.name:  # two shards fit, then the device is full
            raise error
        return original(self, data)

    monkeypatch.setattr(cache_module._HashingWriter, "write", write)
    with pytest.raises(DataError, match="feature cache device is full") as info:
        _extract(utts, tmp_path)
    (entry,) = (tmp_path / "features").iterdir()
    message = str(info.value)
    assert str(entry) in message and "needs about" in message and "data.cache_dir" in message
    assert not list(entry.glob("*.tmp-*")), "a failed write leaves no temporary file"
    done = sorted(p.name for p in entry.glob("shard-*.json"))
    assert done == ["shard-00000.json", "shard-00001.json"] and not (entry / "index.npz").exists()
    monkeypatch.setattr(cache_module._HashingWriter, "write", original)
    _assert_serves(_extract(utts, tmp_path), _reference(_extract(utts, tmp_path / "clean")))

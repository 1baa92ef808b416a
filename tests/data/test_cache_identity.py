"""Cache identity by content: an edit re-extracts only its shard, a moved or copied corpus
reuses every shard, an identical copy over a file is re-hashed but not re-extracted, and a
warm start reads neither the audio nor the transcripts."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from speechattn.data import corpora as corpora_module
from speechattn.data.cache import ExtractionSettings, FeatureStore, open_split, shard_dir
from speechattn.data.cache import extract as extract_module
from speechattn.data.errors import Issues
from speechattn.data.features import FeatureConfig
from speechattn.data.librispeech import scan_split

SETTINGS = ExtractionSettings()
SPLIT = "synth-clean"


@pytest.fixture
def corpus(tiny_corpus, tmp_path) -> Path:
    """A private copy of the tiny corpus (mtimes kept), free to edit."""
    return Path(shutil.copytree(tiny_corpus, tmp_path / "corpus", copy_function=shutil.copy2))


@pytest.fixture
def counted(monkeypatch) -> dict[str, list]:
    """Files fingerprinted (sha256) and scans run, by the cache's own calls."""
    seen: dict[str, list] = {"hashed": [], "scans": []}
    hash_file, scan = extract_module.file_sha256, corpora_module.scan_split
    monkeypatch.setattr(
        extract_module, "file_sha256", lambda p: seen["hashed"].append(Path(p).name) or hash_file(p)
    )
    monkeypatch.setattr(
        corpora_module, "scan_split", lambda *a, **k: seen["scans"].append(a[1]) or scan(*a, **k)
    )
    return seen


def _open(root: Path, cache: Path, extracted: list | None = None, **kw) -> FeatureStore:
    return open_split(
        root, SPLIT, SETTINGS, cache, workers=1, shard_size=5, progress=False,
        on_shard_done=None if extracted is None else extracted.append, **kw,
    )  # fmt: skip


def _features(store: FeatureStore) -> dict[str, np.ndarray]:
    return {u: store.raw(u) for u in store.utt_ids}


def _flac(root: Path, utt_id: str) -> Path:
    speaker, chapter, _ = utt_id.split("-")
    return root / SPLIT / speaker / chapter / f"{utt_id}.flac"


def test_changing_one_file_reextracts_exactly_its_shard(corpus, tmp_path, counted):
    before = _open(corpus, tmp_path / "cache")
    victim, donor = before.utt_ids[7], before.utt_ids[20]
    assert before.shard[7] != before.shard[20]
    _flac(corpus, victim).write_bytes(_flac(corpus, donor).read_bytes())  # new content
    counted["hashed"].clear()
    extracted = []
    after = _open(corpus, tmp_path / "cache", extracted)
    assert extracted == [int(before.shard[7])]  # one shard, the victim's
    assert counted["hashed"] == [f"{victim}.flac"]  # only the changed file is read to hash it
    assert after.shard_keys != before.shard_keys
    changed = {k for k in after.shard_keys if k not in before.shard_keys}
    assert changed == {after.shard_keys[int(after.shard[7])]}
    np.testing.assert_array_equal(after.raw(victim), before.raw(donor))
    for u in before.utt_ids:
        if u != victim:
            np.testing.assert_array_equal(after.raw(u), before.raw(u))


def test_an_identical_copy_over_a_file_is_rehashed_not_reextracted(corpus, tmp_path, counted):
    before = _features(_open(corpus, tmp_path / "cache"))
    flac = _flac(corpus, next(iter(before)))
    shutil.copyfile(flac, tmp_path / "copy.flac")
    (tmp_path / "copy.flac").replace(flac)  # same bytes, new mtime (and inode)
    counted["hashed"].clear()
    extracted = []
    after = _open(corpus, tmp_path / "cache", extracted)
    assert extracted == [] and counted["hashed"] == [flac.name]
    assert _features(after).keys() == before.keys()


def test_a_moved_corpus_reuses_every_shard(corpus, tmp_path, counted):
    cache = tmp_path / "cache"
    first = _open(corpus, cache)
    reference = _features(first)
    n_files = len(counted["hashed"])
    assert n_files == 24

    renamed = corpus.rename(tmp_path / "renamed")  # mtimes kept: nothing is read again
    extracted = []
    moved = _open(renamed, cache, extracted)
    assert extracted == [] and len(counted["hashed"]) == n_files
    assert moved.folder == renamed / SPLIT and moved.shard_keys == first.shard_keys
    assert moved.manifest != first.manifest  # one manifest per folder

    copied = shutil.copytree(renamed, tmp_path / "copied", copy_function=shutil.copyfile)
    extracted = []
    again = _open(Path(copied), cache, extracted)  # new mtimes: hashed again, not extracted
    assert extracted == [] and len(counted["hashed"]) == 2 * n_files
    assert again.shard_keys == first.shard_keys
    for store in (moved, again):
        for u, x in _features(store).items():
            np.testing.assert_array_equal(x, reference[u])


def test_a_warm_start_reads_no_audio_and_no_transcript(corpus, tmp_path, counted):
    first = _open(corpus, tmp_path / "cache")
    assert counted["scans"] == [SPLIT]
    again = _open(corpus, tmp_path / "cache")
    assert counted["scans"] == [SPLIT] and len(counted["hashed"]) == 24  # nothing more
    assert again.utt_ids == first.utt_ids and np.array_equal(again.lengths, first.lengths)
    trans = next((corpus / SPLIT).glob("*/*/*.trans.txt"))
    trans.write_text(trans.read_text())  # the listing changed: scanned (and checked) again
    extracted = []
    _open(corpus, tmp_path / "cache", extracted)
    assert counted["scans"] == [SPLIT, SPLIT] and extracted == []


@pytest.mark.parametrize("change", ["remove", "add"])
def test_adding_or_removing_a_file_reextracts_only_its_neighbourhood(
    change, corpus, tmp_path, counted
):
    before = _open(corpus, tmp_path / "cache")
    utt = before.utt_ids[11]
    speaker, chapter, _ = utt.split("-")
    trans = corpus / SPLIT / speaker / chapter / f"{speaker}-{chapter}.trans.txt"
    if change == "remove":
        _flac(corpus, utt).unlink()
        trans.write_text("".join(ln for ln in trans.open() if not ln.startswith(utt)))
        new = utt
    else:
        new = f"{speaker}-{chapter}-0077"
        shutil.copy2(_flac(corpus, utt), _flac(corpus, new))
        trans.write_text(trans.read_text() + f"{new} A NEW LINE\n")
    extracted = []
    after = _open(corpus, tmp_path / "cache", extracted)
    fresh = [k for k in after.shard_keys if k not in before.shard_keys]
    assert len(extracted) == len(fresh) and 1 <= len(fresh) <= 2
    assert (new in after) == (change == "add") and len(after) == 24 + (1 if change == "add" else -1)


def test_settings_name_the_shard_folder():
    other = [
        dataclasses.replace(SETTINGS, features=FeatureConfig(deltas=True)),
        dataclasses.replace(SETTINGS, dtype="float32"),
        dataclasses.replace(SETTINGS, sample_rate_policy="error"),
    ]
    keys = {s.key for s in [SETTINGS, *other]}
    assert len(keys) == 4 and shard_dir("/c", SETTINGS) == Path(
        f"/c/features/shards/{SETTINGS.key}"
    )


def test_a_recorded_bad_file_is_named_where_it_is_now(corpus, tmp_path):
    bad = sorted((corpus / SPLIT).glob("*/*/*.flac"))[9]
    bad.write_bytes(b"not audio at all")
    first = Issues("skip")
    _open(corpus, tmp_path / "cache", issues=first)
    assert [(s.path, s.problem) for s in first.skips] == [(str(bad), "unreadable audio")]
    moved = corpus.rename(tmp_path / "moved")
    issues = Issues("skip")
    extracted = []
    _open(moved, tmp_path / "cache", extracted, issues=issues)
    assert extracted == [] and [s.path for s in issues.skips] == [str(_flac(moved, bad.stem))]


def test_fingerprints_hashed_in_parallel_belong_to_their_files(corpus, monkeypatch):
    """A pool hashes batches of files; the checksums are paired with the files in order even
    when the first batch finishes last (completion order once gave files others' checksums,
    and processes sharing a cache then disagreed on the shard keys)."""
    utts = scan_split(corpus, SPLIT)
    hash_file, first = extract_module.file_sha256, str(utts[0].path)
    monkeypatch.setattr(
        extract_module, "file_sha256", lambda p: time.sleep(0.5 * (str(p) == first)) or hash_file(p)
    )  # seen by the pool's processes: forked after the patch
    monkeypatch.setattr(extract_module, "HASH_BATCH", 4)
    shas = extract_module.fingerprints(utts, corpus, [], workers=2, progress=False)
    assert shas == [hash_file(u.path) for u in utts]

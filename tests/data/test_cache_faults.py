"""What a hostile world does to the feature cache, and what it gets back: an audio file edited
with its size and mtime restored is re-extracted (never served stale), a crafted index whose
lengths do not fit its shards is refused and rebuilt (never served misaligned), and a commit
record left empty or garbled by a crash repairs itself on the next run."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from speechattn.data.cache import ExtractionSettings, FeatureStore, open_split
from speechattn.data.cache.shards import save_npz
from speechattn.data.errors import DataError
from speechattn.errors import SpeechattnError
from speechattn.utils import TEMP_MARK

SETTINGS = ExtractionSettings()
SPLIT = "synth-clean"


@pytest.fixture
def corpus(tiny_corpus, tmp_path) -> Path:
    """A private copy of the tiny corpus (mtimes kept), free to edit."""
    return Path(shutil.copytree(tiny_corpus, tmp_path / "corpus", copy_function=shutil.copy2))


def _open(root: Path, cache: Path, **kw) -> FeatureStore:
    return open_split(root, SPLIT, SETTINGS, cache, workers=1, shard_size=5, progress=False, **kw)


def _features(store: FeatureStore) -> dict[str, np.ndarray]:
    return {u: store.raw(u) for u in store.utt_ids}


def _assert_same(store: FeatureStore, reference: dict[str, np.ndarray]) -> None:
    assert store.utt_ids == list(reference)
    for u, x in reference.items():
        np.testing.assert_array_equal(store.raw(u), x, err_msg=u)


# ----------------------------------------------------------------------------- edited audio


def test_audio_edited_with_size_and_mtime_restored_is_reextracted(corpus, tmp_path):
    victim = sorted((corpus / SPLIT).glob("*/*/*.flac"))[7]
    audio, rate = sf.read(str(victim), dtype="float32")
    sf.write(victim, audio, rate, format="WAV", subtype="PCM_16")  # fixed size: 44 + 2 N bytes
    stale = _features(_open(corpus, tmp_path / "cache"))
    before = victim.stat()
    sf.write(victim, audio[::-1] * 0.5, rate, format="WAV", subtype="PCM_16")  # new content
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))  # ... under the old mtime
    assert victim.stat().st_size == before.st_size
    assert victim.stat().st_mtime_ns == before.st_mtime_ns
    edited = _open(corpus, tmp_path / "cache")
    fresh = _features(_open(corpus, tmp_path / "clean"))
    _assert_same(edited, fresh)
    assert not np.array_equal(fresh[victim.stem], stale[victim.stem])


def test_verify_cache_rehashes_the_audio(corpus, tmp_path, monkeypatch):
    """`data.verify_cache=true` trusts no recorded fingerprint: every audio file is hashed."""
    from speechattn.data.cache import extract as extract_module

    _open(corpus, tmp_path / "cache")
    hashed, hash_file = [], extract_module.file_sha256
    monkeypatch.setattr(
        extract_module, "file_sha256", lambda p: hashed.append(Path(p).name) or hash_file(p)
    )
    _open(corpus, tmp_path / "cache")
    assert hashed == []  # a warm start reads no audio
    _open(corpus, tmp_path / "cache", verify=True)
    assert len(hashed) == 24


# ----------------------------------------------------------------------------- crafted index


def _craft(store: FeatureStore, edit) -> None:
    """Rewrite the manifest's index arrays through `edit(arrays)` and commit them as the
    extraction would (a well-formed manifest: its json records the new npz)."""
    npz = store.manifest.with_suffix(".npz")
    with np.load(npz) as z:
        arrays = {name: z[name] for name in z.files}
    edit(arrays)
    meta = json.loads(store.manifest.read_text())
    meta["npz"] = save_npz(npz, arrays)
    store.manifest.write_text(json.dumps(meta))


def _shift_frames(arrays) -> None:
    """Move 3 frames from the first utterance to the second, offsets recomputed: every shard
    size still adds up, but two utterances would get each other's frames."""
    length, offset = arrays["length"], arrays["offset"]
    assert arrays["shard"][0] == arrays["shard"][1]
    length[0] -= 3
    length[1] += 3
    offset[1] -= 3


def _grow_lengths(arrays) -> None:
    arrays["length"] *= 2  # past the end of every shard


def _swap_rows(arrays) -> None:
    arrays["row"][[0, 1]] = arrays["row"][[1, 0]]  # statistics of the wrong utterance


@pytest.mark.parametrize("edit", [_shift_frames, _grow_lengths, _swap_rows])
def test_a_crafted_index_is_refused_and_rebuilt(edit, corpus, tmp_path, caplog):
    store = _open(corpus, tmp_path / "cache")
    reference = _features(store)
    _craft(store, edit)
    with pytest.raises(DataError, match="feature cache index does not match its shards") as info:
        _features(FeatureStore(store.manifest))
    assert str(store.manifest) in str(info.value)
    with caplog.at_level(logging.WARNING):
        again = _open(corpus, tmp_path / "cache")
    assert str(store.manifest) in caplog.text and "rebuilding it" in caplog.text
    _assert_same(again, reference)


# ----------------------------------------------------------------------------- commit records


@pytest.mark.parametrize("content", [b"", b"\x00" * 300, b'{"key": "trunc', b"[]", b"{}"])
def test_a_damaged_shard_commit_record_repairs_itself(content, corpus, tmp_path, caplog):
    """A crash (power loss) before the index was written can leave a shard's json empty or
    garbled: the next run re-extracts that shard, and so does the one after."""
    store = _open(corpus, tmp_path / "cache")
    reference = _features(store)
    marker = store.paths(1).marker
    marker.write_bytes(content)
    store.manifest.with_suffix(".npz").unlink()
    with caplog.at_level(logging.WARNING):
        again = _open(corpus, tmp_path / "cache")
    assert f"{marker}: damaged commit record" in caplog.text
    _assert_same(again, reference)
    assert json.loads(marker.read_text())["key"] == store.shard_keys[1]
    _assert_same(_open(corpus, tmp_path / "cache"), reference)


@pytest.mark.parametrize("content", [b"", b"garbage"])
def test_a_damaged_manifest_commit_record_is_rebuilt(content, corpus, tmp_path):
    store = _open(corpus, tmp_path / "cache")
    reference = _features(store)
    store.manifest.write_bytes(content)
    _assert_same(_open(corpus, tmp_path / "cache"), reference)


def test_commits_are_flushed_to_the_device_before_their_renames(tmp_path, monkeypatch):
    """Each file is fsynced before the rename that publishes it, and its folder after, so a
    power loss cannot leave a commit record that points at data never written."""
    from speechattn import utils

    events: list[str] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(utils.os, "fsync", lambda fd: events.append("fsync") or fsync(fd))
    monkeypatch.setattr(
        utils.os, "replace", lambda a, b: events.append(f"rename {Path(b).name}") or replace(a, b)
    )
    utils.atomic_write_text(tmp_path / "x.json", "{}")
    assert events == ["fsync", "rename x.json", "fsync"]
    assert (tmp_path / "x.json").read_text() == "{}"


# ----------------------------------------------------------------------------- full device


@pytest.mark.parametrize("target", ["settings.json", "shard json", "index npz", "index json"])
def test_a_full_device_names_the_cache_file_being_written(target, corpus, tmp_path, monkeypatch):
    """Each of the cache's own files: one SpeechattnError naming it (the shard's with the space
    the extraction needs), not `[Errno 28]` naming nothing; the next run completes the cache."""
    cache = tmp_path / "cache"
    reference = _features(_open(corpus, tmp_path / "clean"))
    full = OSError(errno.ENOSPC, "No space left on device")
    write_bytes = Path.write_bytes

    def is_target(path: Path) -> bool:
        name = path.name.split(TEMP_MARK)[0]
        if target == "settings.json":
            return name == "settings.json"
        if target == "shard json":
            return path.parent.parent.name == "shards" and len(name) == len("0" * 32 + ".json")
        return path.parent.name == "splits" and name.endswith(".json") and "plan" not in name

    def fail_write_bytes(self: Path, data: bytes) -> int:
        if is_target(self):
            raise full
        return write_bytes(self, data)

    def fail_savez(f, **arrays):
        raise full

    if target == "index npz":
        monkeypatch.setattr(np, "savez", fail_savez)
    else:
        monkeypatch.setattr(Path, "write_bytes", fail_write_bytes)
    with pytest.raises(SpeechattnError) as info:
        _open(corpus, cache)
    message = str(info.value)
    if target == "shard json":
        assert "feature cache device is full" in message and "needs about" in message
        assert (
            str(cache / "features" / "shards") in message and ".json: cannot be written" in message
        )
    else:
        name = {"settings.json": "settings.json", "index npz": ".npz", "index json": ".json"}
        assert f"{name[target]}: cannot be written: the device is full" in message
        assert "MiB free in" in message and "Errno" not in message
    assert not list(cache.rglob(f"*{TEMP_MARK}*"))
    monkeypatch.undo()
    _assert_same(_open(corpus, cache), reference)

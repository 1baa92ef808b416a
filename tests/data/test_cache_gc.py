"""`python -m speechattn.data.cache ls|gc`: what is listed, what gc removes, what it keeps (a
live corpus's shards, shards shared with it, young files, claimed shards, a running
extraction's plan), and the one-line hint a run logs about unused cache."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from speechattn.data.cache import ExtractionSettings, FeatureStore, open_split, shard_dir
from speechattn.data.cache import gc as gc_module
from speechattn.data.cache.__main__ import main
from speechattn.data.claims import ClaimConfig, Claims

F16 = ExtractionSettings()
F32 = dataclasses.replace(F16, dtype="float32")
SPLIT = "synth-clean"


def _open(root: Path, cache: Path, settings=F16, extracted: list | None = None) -> FeatureStore:
    return open_split(
        root, SPLIT, settings, cache, workers=1, shard_size=5, progress=False,
        on_shard_done=None if extracted is None else extracted.append,
    )  # fmt: skip


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst, copy_function=shutil.copy2))


def _files(cache: Path) -> set[Path]:
    return {p for p in (cache / "features").rglob("*") if p.is_file()}


@pytest.fixture
def cache_with_garbage(tiny_corpus, tmp_path):
    """A cache holding: corpus `a` (live, float16), corpus `b` (float32, folder since deleted),
    corpus `c` (float16 copy of `a`, deleted: its shards are shared with `a`) and a v2 entry."""
    cache = tmp_path / "cache"
    a = _copy(tiny_corpus, tmp_path / "a")
    live = _open(a, cache)
    b = _copy(tiny_corpus, tmp_path / "b")
    gone = _open(b, cache, F32)
    c = _copy(tiny_corpus, tmp_path / "c")
    _open(c, cache)
    shutil.rmtree(b)
    shutil.rmtree(c)
    old = cache / "features" / "0123456789abcdef"
    old.mkdir()
    (old / "shard-00000.npy").write_bytes(bytes(1000))
    os.utime(old / "shard-00000.npy", (0, 0))
    return cache, a, live, gone, old


def test_ls_lists_corpora_unreferenced_shards_and_old_entries(cache_with_garbage, capsys):
    cache, a, live, gone, old = cache_with_garbage
    main(["ls", "--cache-dir", str(cache)])
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("live", "missing"))]
    assert sorted((r[0], r[1], r[2], r[-1]) for r in rows if r[-1] != "(missing)") == [
        ("live", "24", str(live.num_shards), str(a / SPLIT))
    ]
    missing = [r for r in rows if r[0] == "missing"]
    assert len(missing) == 2 and all(r[-1] == "(missing)" for r in missing)
    assert "unreferenced shards: 0," in out  # b's and c's folders may come back
    assert "2 corpora whose folder is missing keep" in out and "gc --forget-missing" in out
    assert f"old layout (v2): {old}, 1.0 kB" in out
    assert "gc would free" in out


def test_gc_removes_what_no_live_corpus_uses_and_nothing_else(cache_with_garbage, capsys):
    cache, a, live, gone, old = cache_with_garbage
    reference = {u: live.raw(u) for u in live.utt_ids}
    before = _files(cache)
    main(["gc", "--cache-dir", str(cache), "--grace-hours", "0"])  # b and c may come back
    out = capsys.readouterr().out
    assert before - _files(cache) == {old / "shard-00000.npy"} and not old.exists()
    assert "removed 0 stale manifests, 0 unreferenced shards, 1 old-layout" in out
    main(["gc", "--cache-dir", str(cache), "--dry-run", "--grace-hours", "0", "--forget-missing"])
    out = capsys.readouterr().out
    assert f"would remove 2 stale manifests, {gone.num_shards} unreferenced shards, 0 old" in out
    before = _files(cache)
    main(["gc", "--cache-dir", str(cache), "--forget-missing"])  # default grace: all too young
    out = capsys.readouterr().out
    assert before == _files(cache) and f"kept {gone.num_shards} unused shards" in out

    main(["gc", "--cache-dir", str(cache), "--grace-hours", "0", "--forget-missing"])
    out = capsys.readouterr().out
    assert f"removed 2 stale manifests, {gone.num_shards} unreferenced shards, 0 old-layout" in out
    removed = before - _files(cache)
    assert not list(shard_dir(cache, F32).glob("*.npy"))
    assert not any(p.parent == shard_dir(cache, F16) for p in removed)  # a's (= c's) shards stay
    assert {p.name for p in (cache / "features" / "splits").iterdir()} == {
        live.manifest.name,
        live.manifest.with_suffix(".npz").name,
    }
    extracted = []
    again = _open(a, cache, extracted=extracted)
    assert extracted == [] and again.manifest == live.manifest
    for u, x in reference.items():
        np.testing.assert_array_equal(again.raw(u), x)
    main(["ls", "--cache-dir", str(cache)])
    assert "unreferenced shards: 0, 0 B" in capsys.readouterr().out


def test_gc_of_a_changed_corpus_removes_only_the_changed_shard(tiny_corpus, tmp_path):
    cache = tmp_path / "cache"
    a = _copy(tiny_corpus, tmp_path / "a")
    store = _open(a, cache)
    victim = store.utt_ids[7]
    flac = next((a / SPLIT).glob(f"*/*/{victim}.flac"))
    flac.write_bytes(next((a / SPLIT).glob(f"*/*/{store.utt_ids[20]}.flac")).read_bytes())
    survey = gc_module.survey(cache, grace_s=0)
    (m,) = survey.manifests
    assert m.status == "changed" and len(m.in_use) == store.num_shards - 1
    removed = gc_module.collect(cache, grace_s=0)
    assert removed["shards"] == [store.shard_keys[int(store.shard[7])]] and not removed["manifests"]
    extracted = []
    _open(a, cache, extracted=extracted)
    assert extracted == [int(store.shard[7])]


def test_gc_keeps_claimed_shards_and_a_running_extraction(tiny_corpus, tmp_path):
    cache = tmp_path / "cache"
    b = _copy(tiny_corpus, tmp_path / "b")
    store = _open(b, cache)
    shutil.rmtree(b)
    keys = store.shard_keys
    for f in _files(cache):
        os.utime(f, (0, 0))  # everything written long ago ...
    (store.directory / f"{keys[0]}.claim").write_text("host 1 pid 2")  # a live claim
    plan = store.manifest.parent / "0000000000000000.plan.json"  # an extraction in progress
    plan.write_text(json.dumps({"shards": [keys[1]]}))
    removed = gc_module.collect(cache, grace_s=3600)  # ... but the claim and the plan are fresh
    assert set(keys) - set(removed["shards"]) == {keys[0], keys[1]} and removed["manifests"]
    assert store.paths(0).npy.exists() and store.paths(1).npy.exists()
    assert not store.paths(2).npy.exists() and not store.paths(2).marker.exists()


def test_gc_asks_the_claims_module_who_is_still_working(tiny_corpus, tmp_path):
    """Without a grace period only claims protect: a live claim (heartbeat) keeps its shard and
    its temporary files however old; a dead holder's claim protects nothing."""
    # an expiry no pause of this process on a loaded machine reaches: the live claim stays live
    cache, claims = tmp_path / "cache", ClaimConfig(heartbeat_s=0.05, expiry_s=120)
    b = _copy(tiny_corpus, tmp_path / "b")
    store = _open(b, cache)
    keys = store.shard_keys
    temps = [store.directory / f"{key}.npy.tmp-1-abcdef" for key in keys[:2]]
    for temp in temps:
        temp.write_bytes(b"half a file")
        os.utime(temp, (0, 0))
    dead = store.directory / f"{keys[1]}.claim"
    dead.write_text('{"host": "ghost", "pid": 4242, "started": 0, "token": "ghost"}')
    os.utime(dead, (0, 0))
    with Claims(store.directory, claims, host="node9") as live:
        assert live.try_claim(keys[0])
        removed = gc_module.collect(cache, grace_s=0, claim_config=claims)  # corpus b is live
        assert removed["temp_files"] == [temps[1]] and temps[0].is_file()
        shutil.rmtree(b)  # now every shard is unused, once the gone folder is forgotten
        removed = gc_module.collect(cache, grace_s=0, claim_config=claims, forget_missing=True)
        assert removed["kept"] == 1 and keys[0] not in removed["shards"]
        assert set(removed["shards"]) == set(keys[1:]) and not dead.exists()
        assert store.paths(0).npy.exists() and temps[0].is_file()


def test_a_run_says_how_much_cache_no_corpus_uses(cache_with_garbage, caplog, monkeypatch):
    cache, a, *_ = cache_with_garbage
    monkeypatch.setattr(gc_module, "_WARNED", set())
    with caplog.at_level(logging.WARNING):
        _open(a, cache)
        _open(a, cache)  # once per process
    lines = [r.getMessage() for r in caplog.records if "not used by any corpus" in r.getMessage()]
    assert len(lines) == 1 and "python -m speechattn.data.cache gc" in lines[0]
    assert "--forget-missing" in lines[0]  # the unused cache is that of folders now gone
    gc_module.collect(cache, grace_s=0, forget_missing=True)
    monkeypatch.setattr(gc_module, "_WARNED", set())
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _open(a, cache)
    assert "not used by any corpus" not in caplog.text


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_a_missing_or_non_folder_cache_dir_is_refused(tmp_path, command, capsys):
    plain_file = tmp_path / "file"
    plain_file.write_text("x")
    for root, what in ((tmp_path / "nowhere", "does not exist"), (plain_file, "is not a folder")):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--cache-dir", str(root)])
        assert exit_.value.code == 1
        assert f"{root} (--cache-dir) {what}: no feature cache there" in capsys.readouterr().err
    assert plain_file.read_text() == "x"


def test_a_running_extractions_plan_protects_its_shards_whatever_the_grace(tiny_corpus, tmp_path):
    """A plan written on this host is alive exactly while its process runs: with no grace
    period at all, gc keeps what a running extraction needs and forgets a dead one's plan."""
    import subprocess
    import sys

    from speechattn.data.cache.shards import plan_path
    from speechattn.data.claims import host_name

    cache = tmp_path / "cache"
    b = _copy(tiny_corpus, tmp_path / "b")
    store = _open(b, cache)
    shutil.rmtree(b)
    keys = store.shard_keys
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout  # fmt: skip
    running = plan_path(store.manifest, host_name(), os.getpid())
    ended = plan_path(store.manifest, host_name(), int(dead_pid))
    running.write_text(json.dumps({"shards": [keys[0]]}))
    ended.write_text(json.dumps({"shards": [keys[1]]}))
    for f in _files(cache):
        os.utime(f, (0, 0))  # every file old, the plans included
    removed = gc_module.collect(cache, grace_s=0, forget_missing=True)
    assert keys[0] not in removed["shards"] and keys[1] in removed["shards"]
    assert running.is_file() and not ended.exists() and store.paths(0).npy.is_file()


def test_an_extraction_whose_plan_was_removed_writes_it_again(tmp_path, caplog):
    from speechattn.data.cache.extract import _touch_plan

    plan = tmp_path / "m.host-1.plan.json"
    with caplog.at_level(logging.WARNING):
        _touch_plan(plan, tmp_path, F16, ["k0", "k1"])
    assert json.loads(plan.read_text())["shards"] == ["k0", "k1"]
    assert "was removed while its extraction ran" in caplog.text


def test_a_running_job_keeps_every_shard_it_reads(tiny_corpus, tmp_path):
    """A job reading a corpus (its data module marks the manifest as read) keeps all of its
    shards, even one whose audio changed after the job started; once the job is gone, gc
    removes that shard and the job's mark."""
    import subprocess
    import sys

    from speechattn.data.cache.shards import reader_path
    from speechattn.data.cache.store import register_reader
    from speechattn.data.claims import host_name

    cache = tmp_path / "cache"
    a = _copy(tiny_corpus, tmp_path / "a")
    store = _open(a, cache)
    changed = store.shard_keys[int(store.shard[7])]
    flac = next((a / SPLIT).glob(f"*/*/{store.utt_ids[7]}.flac"))
    flac.write_bytes(next((a / SPLIT).glob(f"*/*/{store.utt_ids[20]}.flac")).read_bytes())
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)  # fmt: skip
    ended = reader_path(store.manifest, host_name(), gone)
    ended.touch()  # a job that has ended without removing its mark (SIGKILL)
    register_reader(store.manifest)  # this process reads the corpus, as a training run does
    mine = reader_path(store.manifest, host_name(), os.getpid())
    assert mine.is_file()
    removed = gc_module.collect(cache, grace_s=0)
    assert removed["shards"] == [] and store.paths(int(store.shard[7])).npy.is_file()
    assert not ended.exists() and mine.is_file()
    mine.unlink()  # the job ends
    removed = gc_module.collect(cache, grace_s=0)
    assert removed["shards"] == [changed]

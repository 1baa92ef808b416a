"""Several processes extract into one feature cache at once: processes with
distinct fake host names (`SPEECHATTN_HOST`) extract every shard exactly once between them and
end with the same complete store; a dead holder's shard is taken over; a live holder's shard
is waited for (its temporary files kept), and the wait times out naming it; DDP ranks share
the work through their data modules; the claim settings are validated."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import multiprocessing as mp
import os
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from speechattn.bench.corpus import make_scale_corpus
from speechattn.data import DataConfig, PretrainDataModule
from speechattn.data import config as config_module
from speechattn.data.cache import ExtractionSettings, FeatureStore, open_split, shard_dir
from speechattn.data.cache import shards as shards_module
from speechattn.data.claims import HOST_ENV, ClaimConfig, Claims, ClaimTimeout
from speechattn.utils import temp_name

SPLIT = "train-clean-360"
SETTINGS = ExtractionSettings()
SHARD_SIZE = 4
FAST = ClaimConfig(heartbeat_s=0.05, expiry_s=0.4, wait_timeout_s=30, log_every_s=0.1, poll_s=0.02)
# where a live holder must keep its claim: a loaded machine can leave a process unscheduled for
# longer than FAST's expiry, and its claim would then be taken over by right
LIVE = ClaimConfig(heartbeat_s=0.05, expiry_s=2.0, wait_timeout_s=60, log_every_s=0.1, poll_s=0.02)
STEADY = dataclasses.replace(LIVE, expiry_s=120.0)  # where expiry plays no part
DEADLINE_S = 120  # for what takes seconds: only a hang comes near it
CTX = mp.get_context("fork")  # test functions are not importable by a spawned child


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """96 short utterances (hard links of 0.3-1.1 s sources): about 24 shards of 4."""
    root = tmp_path_factory.mktemp("multinode") / "corpus"
    return make_scale_corpus(root, 96, speakers=4, seconds=[0.3, 0.7, 1.1])


@pytest.fixture(scope="module")
def alone(corpus, tmp_path_factory) -> FeatureStore:
    """The corpus extracted by one process alone."""
    return _open(corpus, tmp_path_factory.mktemp("reference-cache"))


@pytest.fixture(scope="module")
def reference(alone) -> dict[str, str]:
    """sha256 of each utterance's cached features, extracted by one process alone."""
    return _digests(alone)


def _open(root: Path, cache: Path, workers: int = 1, **kw) -> FeatureStore:
    return open_split(
        root, SPLIT, SETTINGS, cache, workers=workers, shard_size=SHARD_SIZE, progress=False,
        claim_config=kw.pop("claim_config", FAST), **kw,
    )  # fmt: skip


def _digests(store: FeatureStore) -> dict[str, str]:
    return {u: hashlib.sha256(store.raw(u).tobytes()).hexdigest() for u in store.utt_ids}


def _count_extractions(log_file: Path, host: str, seconds: float = 0.0) -> None:
    """From now on, each shard this process (or a pool worker it forks) featurises appends
    '<shard key> <host>' to `log_file` (and takes `seconds` longer: the others get a share)."""
    featurise = shards_module._featurise

    def counted(task):
        with open(log_file, "a") as f:  # O_APPEND: one short line is written whole
            f.write(f"{task.key} {host}\n")
        time.sleep(seconds)
        return featurise(task)

    shards_module._featurise = counted


def _extracted(log_file: Path) -> list[tuple[str, str]]:
    if not log_file.is_file():
        return []
    return [tuple(line.split()) for line in log_file.read_text().splitlines()]


def _leftovers(cache: Path) -> list[str]:
    """Claims, temporary files (claims' clock files too) and plans: none once all is done."""
    return sorted(
        str(p.relative_to(cache))
        for p in cache.rglob("*")
        if p.name.endswith((".claim", ".plan.json")) or ".tmp-" in p.name
    )


def _node(host, root, cache, log_file, workers, start, results) -> None:
    _one_thread()
    os.environ[HOST_ENV] = host
    _count_extractions(log_file, host, seconds=0.05)
    start.wait(DEADLINE_S)
    store = _open(root, cache, workers, claim_config=STEADY)
    results.put((host, store.shard_keys, _digests(store)))


def test_nodes_extract_each_shard_once_and_end_with_the_same_store(corpus, reference, tmp_path):
    cache, log_file = tmp_path / "cache", tmp_path / "extracted.log"
    start, results = CTX.Event(), CTX.Queue()
    nodes = [
        CTX.Process(target=_node, args=(host, corpus, cache, log_file, workers, start, results))
        for host, workers in (("node0", 2), ("node1", 1), ("node2", 1))  # a pool, and inline
    ]
    for p in nodes:
        p.start()
    start.set()
    ended = [results.get(timeout=DEADLINE_S) for _ in nodes]
    for p in nodes:
        p.join(DEADLINE_S)
    assert [p.exitcode for p in nodes] == [0, 0, 0]
    keys = ended[0][1]
    assert len(keys) > 12
    extracted = _extracted(log_file)
    assert Counter(key for key, _ in extracted) == Counter(keys)  # every shard exactly once
    assert len({host for _, host in extracted}) >= 2  # shared out, not one node doing it all
    for host, shard_keys, digests in ended:
        assert shard_keys == keys, host
        assert digests == reference, host  # the complete store, identical features everywhere
    assert _leftovers(cache) == []
    assert len(list((cache / "features" / "splits").glob("*.json"))) == 1  # one manifest


def test_a_dead_holders_shard_is_taken_over_and_its_temp_files_removed(
    corpus, alone, reference, tmp_path, caplog
):
    keys = alone.shard_keys  # the shards' names: content keys, the same in every cache
    cache = tmp_path / "cache"
    shards = shard_dir(cache, SETTINGS)
    shards.mkdir(parents=True)
    claim = shards / f"{keys[1]}.claim"  # a holder on host "ghost" that died 1000 s ago
    claim.write_text('{"host": "ghost", "pid": 4242, "started": 0, "token": "ghost"}')
    temp = shards / f"{keys[1]}.npy.tmp-4242-abcdef"  # the half file it was writing
    temp.write_bytes(b"half a shard")
    for path in (claim, temp):
        os.utime(path, (time.time() - 1000,) * 2)
    extracted = []
    with caplog.at_level(logging.WARNING, "speechattn.data.claims"):
        store = _open(corpus, cache, on_shard_done=extracted.append)
    assert sorted(extracted) == list(range(len(keys)))  # shard 1 too
    assert "took over the claim of ghost pid 4242" in caplog.text
    assert _digests(store) == reference
    assert _leftovers(cache) == []


def _hold(cache, key, others, ready, report, seconds) -> None:
    """Node9: claims shard `key`, starts writing it (a temporary file, old: only the live claim
    protects it), stays alive (heartbeats) until the shards `others` are committed, then
    `seconds` more, then gives up without finishing."""
    os.environ[HOST_ENV] = "node9"
    directory = shard_dir(cache, SETTINGS)
    with Claims(directory, LIVE) as claims:
        assert claims.try_claim(key)
        temp = temp_name(directory / f"{key}.npy")
        temp.write_bytes(b"half a shard")
        os.utime(temp, (time.time() - 1000,) * 2)
        ready.set()
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and not all(
            shards_module.shard_paths(directory, other).marker.is_file() for other in others
        ):
            time.sleep(0.02)
        time.sleep(seconds)
        report.put(temp.is_file() and claims.holds(key))
        temp.unlink()
        claims.release(key)  # undone: the waiting process takes the shard


def _held_shard(keys: list[str], tmp_path: Path, seconds: float, others: list[str] | None = None):
    """A cache in which node9 (`_hold`) holds shard 1 until the shards `others` are committed,
    then `seconds` more."""
    cache = tmp_path / "cache"
    shard_dir(cache, SETTINGS).mkdir(parents=True)
    ready, report = CTX.Event(), CTX.Queue()
    holder = CTX.Process(target=_hold, args=(cache, keys[1], others or [], ready, report, seconds))
    holder.start()
    assert ready.wait(DEADLINE_S)
    return cache, keys, holder, report


def test_a_live_holders_shard_is_waited_for_and_its_temp_files_kept(
    corpus, alone, reference, tmp_path, caplog
):
    # held until we have extracted every other shard, then over 3 expiries more: we wait for
    # it (and say so) while it is still held, however long our own shards took
    keys = alone.shard_keys
    others = [key for key in keys if key != keys[1]]
    cache, keys, holder, report = _held_shard(keys, tmp_path, 3 * LIVE.expiry_s + 0.5, others)
    extracted = []
    with caplog.at_level(logging.INFO, "speechattn.data.claims"):
        store = _open(corpus, cache, on_shard_done=extracted.append, claim_config=LIVE)
    holder.join(DEADLINE_S)
    assert holder.exitcode == 0
    assert report.get(timeout=5) is True  # its temp file survived our clean-up, its claim ours
    assert f"waiting for 1 shards claimed by other processes: node9 pid {holder.pid} " in (
        caplog.text
    )
    assert "took over" not in caplog.text
    assert sorted(extracted) == list(range(len(keys)))  # released undone: extracted here
    assert _digests(store) == reference
    assert _leftovers(cache) == []


def test_the_wait_times_out_naming_the_shard_its_holder_and_claim_file(corpus, alone, tmp_path):
    cache, keys, holder, _ = _held_shard(alone.shard_keys, tmp_path, seconds=DEADLINE_S)
    # node9's claim stays live (STEADY's expiry) however long a loaded machine pauses it
    patience = dataclasses.replace(STEADY, wait_timeout_s=0.5)
    try:
        with pytest.raises(ClaimTimeout) as error:
            _open(corpus, cache, claim_config=patience)
    finally:
        holder.kill()
        holder.join(DEADLINE_S)
    claim = shard_dir(cache, SETTINGS) / f"{keys[1]}.claim"
    message = str(error.value)
    assert message.startswith(f"{claim}: timed out waiting for shards claimed by other processes")
    assert f"{keys[1]} (claimed by node9 pid {holder.pid} since " in message
    assert "data.cache_wait_timeout_s" in message
    assert not list((cache / "features" / "splits").glob("*[0-9a-f].json"))  # no manifest
    assert [p.name for p in shard_dir(cache, SETTINGS).glob("*.claim")] == [claim.name]


def _one_thread() -> None:
    """What a forked child of the test process needs before any torch op: the parent's OpenMP
    team (MKL's vector maths use it) does not survive a fork, and a child using it waits on
    it forever. Real ranks are fresh processes; the extraction pool's workers do this too."""
    torch.set_num_threads(1)


def _rank(rank, cfg, log_file, results) -> None:
    """A DDP rank as Lightning runs it: prepare_data on local rank 0 only, setup on each."""
    _one_thread()
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    _count_extractions(log_file, f"rank{rank}", seconds=0.1)  # one rank alone: over 2 s
    dm = PretrainDataModule(cfg)
    if rank == 0:
        dm.prepare_data()
    dm.setup("fit")
    results.put((rank, dm.datasets["train"].utt_ids, dm.normalizer.mean.tolist()))


@pytest.mark.slow
def test_ddp_ranks_extract_together_in_setup(corpus, tmp_path):
    cfg = DataConfig(
        corpus="librispeech", root=str(corpus), cache_dir=str(tmp_path / "cache"),
        pretrain_splits=[SPLIT], labelled_splits=[SPLIT], shard_size=SHARD_SIZE,
        extract_workers=1, progress=False, claim_heartbeat_s=0.2, claim_expiry_s=STEADY.expiry_s,
        cache_wait_log_s=0.1,
    )  # fmt: skip
    log_file, results = tmp_path / "extracted.log", CTX.Queue()
    ranks = [CTX.Process(target=_rank, args=(r, cfg, log_file, results)) for r in (0, 1)]
    for p in ranks:
        p.start()
    ended = sorted(results.get(timeout=DEADLINE_S) for _ in ranks)
    for p in ranks:
        p.join(DEADLINE_S)
    assert [p.exitcode for p in ranks] == [0, 0]
    (_, train0, mean0), (_, train1, mean1) = ended
    assert train0 == train1 and mean0 == mean1 and len(train0) > 80
    extracted = _extracted(log_file)
    assert len(extracted) == len({key for key, _ in extracted}) > 12  # each shard once
    assert {rank for _, rank in extracted} == {"rank0", "rank1"}  # both ranks extracted
    assert _leftovers(tmp_path / "cache") == []


def test_claim_settings_are_validated_and_extraction_workers_share_the_node(monkeypatch):
    cfg = DataConfig(claim_heartbeat_s=1, claim_expiry_s=5, cache_wait_timeout_s=7)
    assert cfg.claim_config() == ClaimConfig(
        heartbeat_s=1, expiry_s=5, wait_timeout_s=7, log_every_s=60
    )
    assert DataConfig().claim_config() == ClaimConfig()  # defaults in one place
    with pytest.raises(ValueError, match=r"data.claim_expiry_s=20.*at least 3 x heartbeat_s"):
        DataConfig(claim_expiry_s=20)
    with pytest.raises(ValueError, match=r"data.cache_wait_log_s=0.*log_every_s must be > 0"):
        DataConfig(cache_wait_log_s=0)
    with pytest.raises(
        ValueError, match="data.extract_workers=0: must be an integer >= 1, or null"
    ):
        DataConfig(extract_workers=0)
    monkeypatch.setattr(config_module, "usable_cpus", lambda: 16)
    for name in ("LOCAL_WORLD_SIZE", "SLURM_CPUS_PER_TASK", "SLURM_NTASKS_PER_NODE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert DataConfig().extraction_workers == 8  # alone: all cores, at most 8
    monkeypatch.setenv("WORLD_SIZE", "4")  # Lightning's launcher: 4 ranks on these cores
    assert DataConfig().extraction_workers == 4
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")  # 8 SLURM tasks on each of 2 nodes
    assert DataConfig().extraction_workers == 2
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")  # ... each with 3 cores of its own
    assert DataConfig().extraction_workers == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # torchrun: its ranks share the cores
    assert DataConfig().extraction_workers == 1
    assert DataConfig(extract_workers=5).extraction_workers == 5

"""Shards: cutting a folder's utterances into shards (`plan_shards`), and extracting one shard
into its three files (`extract_shard`, in the process pool of `extract.py`)."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speechattn.data.audio import load_audio
from speechattn.data.cache.integrity import read_marker, save_npy, write_marker
from speechattn.data.cache.layout import DATA_KINDS, ExtractionSettings, ShardPaths
from speechattn.data.errors import DataError
from speechattn.data.features import cached_log_mel, min_samples_for
from speechattn.data.utterances import Segment
from speechattn.utils import init_pool_worker, out_of_space

log = logging.getLogger(__name__)

MAX_SHARD_FACTOR = 3  # a shard holds at most this many times `shard_size` utterances


def _boundary(utt_id: str, shard_size: int) -> bool:
    """Whether a shard ends after `utt_id`: 1 in `shard_size` ids, chosen by a hash of the id
    alone, so adding, removing or changing one file moves no other boundary."""
    h = hashlib.blake2b(utt_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % shard_size == 0


def plan_shards(utt_ids: Sequence[str], shard_size: int) -> list[tuple[int, int]]:
    """Content-defined shards of `utt_ids` (in the given order) as (start, end) index ranges:
    `shard_size` utterances on average, at most `MAX_SHARD_FACTOR * shard_size`."""
    cap = MAX_SHARD_FACTOR * shard_size
    ranges, start = [], 0
    for i, utt_id in enumerate(utt_ids):
        if _boundary(utt_id, shard_size) or i + 1 - start >= cap:
            ranges.append((start, i + 1))
            start = i + 1
    if start < len(utt_ids):
        ranges.append((start, len(utt_ids)))
    return ranges


@dataclass
class ShardTask:
    """One shard to extract (picklable: handed to a worker process)."""

    directory: str
    key: str
    index: int  # position in this extraction's plan (what `on_shard_done` receives)
    items: list[tuple[str, str, Segment | None]]  # (utt_id, path, the part of it read)
    settings: ExtractionSettings
    total_utterances: int  # of the whole extraction, to estimate the space it needs


@dataclass
class ShardResult:
    """A committed shard: its position in the plan and the commit marker written."""

    index: int
    marker: dict[str, Any]


def _featurise(task: ShardTask) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Decode and featurise a shard's utterances: its two arrays and its marker (no files)."""
    import torch

    s = task.settings
    mel = cached_log_mel(s.features)
    dtype = np.float16 if s.dtype == "float16" else np.float32
    min_samples = min_samples_for(s.min_frames)
    feats, stats, ids, lengths, failures, notes = [], [], [], [], [], []
    seconds = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one utterance is small; parallelism comes from processes
    try:
        for utt_id, path, segment in task.items:
            try:
                audio = load_audio(path, s.sample_rate_policy, min_samples, utt_id, segment)
            except DataError as e:
                failures.append({"utt_id": utt_id, "problem": e.problem, "detail": e.detail})
                continue
            x = mel(audio.audio).numpy()  # (T, F) float32
            stored = x.astype(dtype)
            exact = stored.astype(np.float64)  # statistics of what loading will return
            feats.append(stored)
            stats.append(np.stack([exact.sum(0), (exact**2).sum(0)]))  # (2, F)
            ids.append(utt_id)
            lengths.append(len(x))
            notes += [[utt_id, n] for n in audio.notes]
            seconds += len(audio.audio) / 16000
    finally:
        torch.set_num_threads(threads)
    F = s.features.dim
    arrays = {
        "npy": np.concatenate(feats) if feats else np.zeros((0, F), dtype),  # (frames, F)
        "stats": np.stack(stats) if stats else np.zeros((0, 2, F)),  # (utterances, 2, F)
    }
    marker = {"key": task.key, "utt_ids": ids, "lengths": lengths, "failures": failures,
              "notes": notes, "seconds": seconds}  # fmt: skip
    return arrays, marker


def extract_shard(task: ShardTask) -> ShardResult:
    """Extract one shard and write its three files, the commit marker last (the caller holds
    the shard's claim)."""
    paths = ShardPaths(Path(task.directory), task.key)
    arrays, marker = _featurise(task)
    try:
        if (done := read_marker(paths.marker)) is not None:  # taken over while this one slept
            return _finished_elsewhere(task, done)
        marker["files"] = {kind: save_npy(paths.data(kind), arrays[kind]) for kind in DATA_KINDS}
        write_marker(paths.marker, marker)  # commit
    except FileNotFoundError:
        # our temporary file went: another process took the claim over (this one was stopped
        # past the claims' expiry) and cleaned up; its commit stands, ours is not needed
        done = read_marker(paths.marker)
        if done is None:
            raise
        return _finished_elsewhere(task, done)
    except OSError as e:
        if not out_of_space(e):
            raise
        shard_bytes = sum(a.nbytes for a in arrays.values())
        need = shard_bytes / max(len(task.items), 1) * task.total_utterances
        free = shutil.disk_usage(paths.directory).free
        raise DataError(
            paths.directory,
            "feature cache device is full",
            f"writing shard {task.key} failed ({e}); {free / 2**20:.0f} MiB free, and "
            f"extracting all {task.total_utterances} utterances needs about "
            f"{need / 2**20:.0f} MiB. Free space there or set data.cache_dir to another "
            f"disk; finished shards are kept and nothing half-written is used",
        ) from None
    return ShardResult(task.index, marker)


def _finished_elsewhere(task: ShardTask, marker: dict[str, Any]) -> ShardResult:
    """The result of a shard another process committed while this one was stopped."""
    log.warning(
        "shard %s was finished by another process while this one was stopped (its claim "
        "expired and was taken over); this process uses that result and writes nothing",
        task.key,
    )
    return ShardResult(task.index, marker)


@contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """`workers` processes (one thread each), ended on leaving; None for one worker (inline).
    concurrent.futures' pool: when a worker dies, pending tasks fail with `BrokenProcessPool`
    (`multiprocessing.Pool` would wait forever)."""
    if workers <= 1:
        yield None
        return
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    context = mp.get_context(method)
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=init_pool_worker)
    try:
        yield pool
    except BaseException:  # an error, or the caller stopped early: busy workers end now
        _terminate_workers(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _terminate_workers(pool: ProcessPoolExecutor) -> None:
    """SIGTERM to every worker (Python 3.14's `terminate_workers`, else the process table)."""
    if hasattr(pool, "terminate_workers"):
        pool.terminate_workers()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()


def map_in_processes(fn: Callable[[Any], Any], items: list[Any], workers: int) -> Iterator[Any]:
    """`fn` over `items`, in `workers` processes or inline; results in the order of `items`."""
    with process_pool(min(workers, len(items))) as pool:
        yield from map(fn, items) if pool is None else pool.map(fn, items)

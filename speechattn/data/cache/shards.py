"""Shards on disk: their names, their files' records and commit markers, and extracting one.

Each data file's record (size, shape, dtype, sha256, mtime_ns) is taken as it is written; the
commit marker holding the records, written last, is the source of truth (every manifest using
the shard holds a copy). Layout and integrity rules: docs/cache.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from numpy.lib import format as npy_format

from speechattn.data.audio import load_audio
from speechattn.data.errors import DataError
from speechattn.data.features import FeatureConfig, cached_log_mel, min_samples_for
from speechattn.data.utterances import Segment
from speechattn.utils import atomic_path, atomic_write_text, digest, init_pool_worker, out_of_space

log = logging.getLogger(__name__)

# 3: content-addressed shards shared by every corpus folder, per-folder manifests
CACHE_VERSION = 3
MAX_SHARD_FACTOR = 3  # a shard holds at most this many times `shard_size` utterances
OLD_ENTRY_RE = re.compile(r"^[0-9a-f]{16}$")  # a version-2 entry: features/<key>/
DATA_KINDS = ("npy", "stats")  # a shard's two data files, as named in the records
Record = dict[str, Any]  # size, shape, dtype, sha256, mtime_ns


@dataclass(frozen=True)
class ExtractionSettings:
    """Everything that changes what gets cached."""

    features: FeatureConfig = FeatureConfig()
    sample_rate_policy: str = "resample"
    min_frames: int = 1
    dtype: str = "float16"

    def fingerprint(self) -> dict[str, Any]:
        return {
            "cache_version": CACHE_VERSION,
            **self.features.fingerprint(),
            "sample_rate_policy": self.sample_rate_policy,
            "min_frames": self.min_frames,
            "dtype": self.dtype,
        }

    @property
    def key(self) -> str:
        """16 hex digits naming the folder of every shard extracted with these settings."""
        return digest(self.fingerprint())


def features_root(cache_root: str | Path) -> Path:
    return Path(cache_root).expanduser() / "features"


def shard_dir(cache_root: str | Path, settings: ExtractionSettings) -> Path:
    return features_root(cache_root) / "shards" / settings.key


def splits_dir(cache_root: str | Path) -> Path:
    return features_root(cache_root) / "splits"


def manifest_key(folder: str | Path, settings: ExtractionSettings) -> str:
    """A corpus folder's manifest name: its absolute path and the settings (16 hex digits)."""
    return digest({"folder": str(folder), "settings": settings.key})


def shard_key(settings: ExtractionSettings, members: list[tuple[str, int, str]]) -> str:
    """A shard's name: the settings and its utterances' (id, size, sha256) -- 32 hex digits.
    The same audio under the same ids gives the same shard wherever the corpus lives."""
    lines = (f"{utt_id}\t{size}\t{sha}\n" for utt_id, size, sha in members)
    return digest(settings.fingerprint(), lines, length=32)


class ShardPaths(NamedTuple):
    """The three files of one shard; the data files are named as in `DATA_KINDS`."""

    npy: Path  # (frames, F) features
    stats: Path  # (utterances, 2, F) sums and sums of squares
    marker: Path  # the json commit marker


def shard_paths(directory: Path, key: str) -> ShardPaths:
    return ShardPaths(*(directory / f"{key}.{end}" for end in ("npy", "stats.npy", "json")))


def shard_of(name: str) -> str | None:
    """The shard key of a settings folder's file (`<key>.npy`, `.stats.npy`, `.json`, `.claim`,
    their temporary names); None for the others (`settings.json`, a claims clock file)."""
    key = name.split(".", 1)[0]
    return key if re.fullmatch(r"[0-9a-f]{32}", key) else None


def manifest_of(name: str) -> str | None:
    """The manifest key of a splits folder's file (`<key>.json`, `<key>.npz`, their temporary
    names); None for the others (plans, a claims clock file)."""
    key, _, rest = name.partition(".")
    return key if re.fullmatch(r"[0-9a-f]{16}", key) and rest in ("json", "npz") else None


def file_host(host: str) -> str:
    """A host name as it appears in a file name, whatever $SPEECHATTN_HOST holds."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host)


def plan_path(manifest: Path, host: str, pid: int) -> Path:
    """The plan of one process's extraction for a manifest (`gc` keeps its shards)."""
    return manifest.with_name(f"{manifest.stem}.{file_host(host)}-{pid}.plan.json")


def reader_path(manifest: Path, host: str, pid: int) -> Path:
    """The mark of one process reading a manifest's shards (`gc` keeps them)."""
    return manifest.with_name(f"{manifest.stem}.{file_host(host)}-{pid}.reader")


def owner(path: Path) -> tuple[str, int] | None:
    """(host as in file names, pid) of the process a plan or reader file belongs to, or None
    for a name `plan_path` / `reader_path` did not make."""
    found = re.fullmatch(r"[^.]+\.(.+)-(\d+)\.(?:plan\.json|reader)", path.name)
    return (found.group(1), int(found.group(2))) if found else None


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class _HashingWriter:
    """A binary file that hashes what is written (np.save then streams through `write`)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.f.write(data)


def save_npy(path: Path, array: np.ndarray) -> Record:
    """Write `array` as `path` atomically; returns its record (sha256 of the bytes written)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            out = _HashingWriter(f)
            np.save(out, array)
        mtime_ns = os.stat(tmp).st_mtime_ns  # a rename keeps it
    return {
        "size": out.size,
        "shape": list(array.shape),
        "dtype": array.dtype.str,
        "sha256": out.sha256.hexdigest(),
        "mtime_ns": mtime_ns,
    }


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """Write `arrays` as an uncompressed `path` atomically; returns its size and mtime_ns."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        st = os.stat(tmp)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def same_stat(st: os.stat_result, record: Record) -> bool:
    return st.st_size == record["size"] and st.st_mtime_ns == record["mtime_ns"]


def parse_header(head: bytes, record: Record) -> tuple[int, str | None]:
    """(offset of the array data, None) when `head` (a .npy file's first bytes) describes the
    recorded shape and dtype, else (0, what is wrong)."""
    f = io.BytesIO(head)
    try:
        v1 = npy_format.read_magic(f) == (1, 0)
        read = npy_format.read_array_header_1_0 if v1 else npy_format.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except Exception as e:  # ValueError, SyntaxError, tokenize.TokenError, ... from a bad header
        return 0, f"damaged .npy header ({type(e).__name__}: {str(e)[:80]})"
    if list(shape) != list(record["shape"]) or dtype.str != record["dtype"] or fortran:
        expected = f"{record['dtype']} {record['shape']}"
        return 0, f"header says {dtype.str} {list(shape)}, expected {expected}"
    return f.tell(), None


def read_marker(path: Path) -> dict[str, Any] | None:
    """A shard's commit marker, or None when the shard is not committed: no marker, or a
    damaged one (empty, garbled or inconsistent), removed with a warning so the shard is
    re-extracted. Other errors (EMFILE, EACCES, EIO) are raised."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        marker = json.loads(raw)
        problem = _marker_problem(marker)
    except ValueError as e:  # UnicodeDecodeError too
        problem = f"not JSON: {str(e)[:80]}"
    if problem is None:
        return marker
    log.warning("%s: damaged commit record (%s); re-extracting its shard", path, problem)
    path.unlink(missing_ok=True)
    return None


def _marker_problem(marker: Any) -> str | None:
    """What is wrong with a parsed commit marker (`extract_shard` writes it), or None."""
    try:
        files, ids, lengths = marker["files"], marker["utt_ids"], marker["lengths"]
        records = [files[kind] for kind in DATA_KINDS]
        for record in records:
            for field in ("size", "mtime_ns", "sha256", "dtype", "shape"):
                record[field]
        list(marker["failures"]), list(marker["notes"]), float(marker["seconds"])
        if not (isinstance(ids, list) and isinstance(lengths, list) and len(ids) == len(lengths)):
            return "utterance ids and lengths do not pair up"
        if records[1]["shape"][:1] != [len(ids)] or records[0]["shape"][:1] != [sum(lengths)]:
            return f"{len(ids)} utterances of {sum(lengths)} frames, files of other shapes"
    except (KeyError, TypeError, IndexError, ValueError) as e:
        return f"{type(e).__name__}: {str(e)[:80]}"
    return None


def reconcile(
    paths: ShardPaths, kind: str, cached: Record | None, verify: bool
) -> tuple[Record | None, str | None]:
    """(its current record, None) when the shard's data file `kind` is what was written, else
    (None, problem). A stat matching `cached` (a manifest's copy) or the marker is trusted; a
    size match under another mtime is checksummed (the marker then records the new mtime);
    `verify` checksums in every case."""
    path = getattr(paths, kind)
    try:
        st = os.stat(path)
    except FileNotFoundError:  # other errors (EACCES, EIO) say nothing about the bytes: raised
        return None, "missing"
    if not verify and cached is not None and same_stat(st, cached):
        return cached, None
    marker = read_marker(paths.marker)
    if marker is None:
        return None, f"its commit marker {paths.marker.name} is missing (not fully extracted)"
    record = marker["files"][kind]
    if not verify and same_stat(st, record):
        return record, None
    if st.st_size != record["size"]:
        return None, f"{st.st_size} bytes instead of {record['size']} (truncated or overwritten)"
    if file_sha256(path) != record["sha256"]:
        return None, "checksum mismatch: its bytes changed after extraction"
    if st.st_mtime_ns != record["mtime_ns"]:  # same bytes, new mtime: remember it
        record = {**record, "mtime_ns": st.st_mtime_ns}
        marker["files"][kind] = record
        with suppress(OSError):  # a read-only cache: this file is checksummed again next time
            atomic_write_text(paths.marker, json.dumps(marker))
    return record, None


def invalidate(paths: ShardPaths, damaged: Path | None = None) -> None:
    """Mark a shard as not extracted (its commit marker goes first) and delete a damaged file,
    so every manifest that uses the shard finds it missing and has it re-extracted."""
    paths.marker.unlink(missing_ok=True)
    if damaged is not None:
        damaged.unlink(missing_ok=True)


def intact(paths: ShardPaths, verify: bool) -> dict[str, Any] | None:
    """A committed shard's marker when both data files are what it records, else None (the
    damaged file named in a warning, the shard marked for re-extraction)."""
    marker = read_marker(paths.marker)
    if marker is None:
        return None
    for kind in DATA_KINDS:
        record, problem = reconcile(paths, kind, marker["files"][kind], verify)
        if problem:
            path = getattr(paths, kind)
            log.warning("feature cache: %s: %s; re-extracting its shard", path, problem)
            invalidate(paths, path)
            return None
        marker["files"][kind] = record
    return marker


def plan_shards(utt_ids: Sequence[str], shard_size: int) -> list[tuple[int, int]]:
    """Content-defined shards of `utt_ids` (in the given order) as (start, end) index ranges:
    `shard_size` utterances on average, at most `MAX_SHARD_FACTOR * shard_size`. A shard ends
    after 1 in `shard_size` ids, chosen by a hash of the id alone: adding, removing or changing
    one file moves no other boundary."""
    cap = MAX_SHARD_FACTOR * shard_size
    ranges, start = [], 0
    for i, utt_id in enumerate(utt_ids):
        h = hashlib.blake2b(utt_id.encode(), digest_size=8).digest()
        if int.from_bytes(h, "little") % shard_size == 0 or i + 1 - start >= cap:
            ranges.append((start, i + 1))
            start = i + 1
    if start < len(utt_ids):
        ranges.append((start, len(utt_ids)))
    return ranges


@dataclass
class ShardTask:
    """One shard to extract (picklable: handed to a worker process)."""

    directory: Path
    key: str
    items: list[tuple[str, str, Segment | None]]  # (utt_id, path, the part of it read)
    settings: ExtractionSettings
    total_utterances: int  # of the whole extraction, to estimate the space it needs


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
    marker = {
        "key": task.key,
        "utt_ids": ids,
        "lengths": lengths,
        "failures": failures,
        "notes": notes,
        "seconds": seconds,
    }
    return arrays, marker


def extract_shard(task: ShardTask) -> dict[str, Any]:
    """Extract one shard and write its three files, the commit marker last (the caller holds
    the shard's claim); returns the marker."""
    paths = shard_paths(task.directory, task.key)
    arrays, marker = _featurise(task)
    try:
        if (done := read_marker(paths.marker)) is None:  # else: taken over while this one slept
            marker["files"] = {
                kind: save_npy(getattr(paths, kind), arrays[kind]) for kind in DATA_KINDS
            }
            atomic_write_text(paths.marker, json.dumps(marker))  # commit
            return marker
    except FileNotFoundError:
        # our temporary file went: another process took the claim over (this one was stopped
        # past the claims' expiry) and cleaned up; its commit stands, ours is not needed
        if (done := read_marker(paths.marker)) is None:
            raise
    except OSError as e:
        if not out_of_space(e):
            raise
        shard_bytes = sum(a.nbytes for a in arrays.values())
        need = shard_bytes / max(len(task.items), 1) * task.total_utterances
        free = shutil.disk_usage(task.directory).free
        raise DataError(
            task.directory,
            "feature cache device is full",
            f"writing shard {task.key} failed ({e}); {free / 2**20:.0f} MiB free, and "
            f"extracting all {task.total_utterances} utterances needs about "
            f"{need / 2**20:.0f} MiB. Free space there or set data.cache_dir to another "
            f"disk; finished shards are kept and nothing half-written is used",
        ) from None
    log.warning(
        "shard %s was finished by another process while this one was stopped (its claim "
        "expired and was taken over); this process uses that result and writes nothing",
        task.key,
    )
    return done


@contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """`workers` processes (one thread each), ended on leaving; None for one worker (inline).
    concurrent.futures' pool: when a worker dies, pending tasks fail with `BrokenProcessPool`
    (`multiprocessing.Pool` would wait forever)."""
    if workers <= 1:
        yield None
        return
    context = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=init_pool_worker)
    try:
        yield pool
    except BaseException:  # an error, or the caller stopped early: busy workers end now
        if hasattr(pool, "terminate_workers"):  # Python 3.14
            pool.terminate_workers()
        else:
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()  # SIGTERM
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def map_in_processes(fn: Callable[[Any], Any], items: list[Any], workers: int) -> Iterator[Any]:
    """`fn` over `items`, in `workers` processes or inline; results in the order of `items`."""
    with process_pool(min(workers, len(items))) as pool:
        yield from map(fn, items) if pool is None else pool.map(fn, items)

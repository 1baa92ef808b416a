"""On-disk feature cache: extract once, in parallel, resumable, memory-mapped (SPEC 2.4).

One cache entry per list of utterances (the data modules use one per split folder):

    <cache_root>/features/<key>/          key = sha256(feature settings + file list)[:16]
        settings.json                     the settings and the number of shards
        shard-00000.npy                   (frames, F) float16/32: the shard's utterances, concatenated
        shard-00000.stats.npy             (utterances, 2, F) float64 per-utterance sum and sum of squares
        shard-00000.json                  utterance ids, frame counts, failures, notes, and the
                                          size/shape/sha256 of the two .npy files  <- commit marker
        index.json                        failures, notes, every shard file's size/shape/sha256
        index.npz                         all shards' ids/offsets, written when every shard is done

The file list part of the key is (utt id, absolute path, size, mtime), so a changed corpus gets a
new entry. Every file is written to a temporary name and renamed (atomic on POSIX); a shard
counts as done only once its json exists, and the json is written last. A killed extraction
therefore leaves at most stray temporary files (removed on the next run) and a rerun skips the
done shards. Bad audio is recorded in the shard json, so a rerun reports it again without
decoding. Loading memory-maps each shard's .npy: a lookup is a slice, not a file open.

Integrity: a cache file is never served unless it matches what was written. Opening an entry
checks every file's size and .npy header (cheap) and the statistics files' checksums (small);
`verify=True` (`data.verify_cache=true`) also checksums every feature shard up front. Otherwise
each feature shard is checksummed once per process, on its first read (sha256 runs at over
1 GB/s, far above what training consumes). A damaged shard found at open is re-extracted with a
warning; one found on first read is invalidated (its commit marker removed) and raises
`DataError` naming the file, so rerunning the same command re-extracts it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from speechattn.data.audio import load_audio
from speechattn.data.errors import DataError, Issues, Skip
from speechattn.data.features import FeatureConfig, LogMel, min_samples_for
from speechattn.data.librispeech import Utterance
from speechattn.utils import TEMP_MARK, atomic_path, atomic_write_text, digest, progress_bar

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: shard sizes and checksums in the index
_TMP_RE = re.compile(re.escape(TEMP_MARK) + r"(\d+)-")
_VERIFIED: set[tuple[str, str]] = set()  # (path, sha256) checksummed in this process


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


def cache_key(utterances: Sequence[Utterance], settings: ExtractionSettings) -> str:
    """Hash of the settings and the file list (id, path, size, mtime) -- 16 hex digits."""
    lines = (f"{u.utt_id}\t{u.path}\t{u.size}\t{u.mtime_ns}\n" for u in utterances)
    return digest(settings.fingerprint(), lines)


# ----------------------------------------------------------------------------- integrity


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_npy(path: Path, record: dict[str, Any], checksum: bool, once: bool = True) -> str | None:
    """None when the .npy file at `path` matches its `record` (size, shape, dtype, sha256,
    as written at extraction), else what is wrong with it, in words. With `once`, a file
    already checksummed in this process is not hashed again."""
    try:
        size = path.stat().st_size
    except OSError as e:
        return f"missing or unreadable ({e.strerror})"
    if size != record["size"]:
        return f"{size} bytes instead of {record['size']} (truncated or overwritten)"
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0
            if version != (1, 0):
                read = np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
    except Exception as e:  # ValueError, SyntaxError, tokenize.TokenError, ... from a bad header
        return f"damaged .npy header ({type(e).__name__}: {str(e)[:80]})"
    if list(shape) != list(record["shape"]) or dtype.str != record["dtype"] or fortran:
        return (
            f"header says {dtype.str} {list(shape)}, expected {record['dtype']} {record['shape']}"
        )
    if checksum and (not once or (str(path), record["sha256"]) not in _VERIFIED):
        if file_sha256(path) != record["sha256"]:
            return "checksum mismatch: its bytes changed after extraction"
        _VERIFIED.add((str(path), record["sha256"]))
    return None


def _shard_files(k: int) -> tuple[str, str]:
    """Names of shard k's feature and statistics files."""
    return f"shard-{k:05d}.npy", f"shard-{k:05d}.stats.npy"


def invalidate_shard(directory: Path, k: int) -> None:
    """Mark shard k as not extracted: the next extraction of this entry redoes it."""
    (directory / "index.npz").unlink(missing_ok=True)  # first: the entry is no longer complete
    (directory / f"shard-{k:05d}.json").unlink(missing_ok=True)


# ----------------------------------------------------------------------------- loading


class FeatureStore:
    """Read access to a complete cache entry.

    `lengths[i]` frames for `utt_ids[i]`; `features(i)` -> float32 (T, F) copy of a memory-mapped
    slice. Picklable (memory maps reopen lazily in each DataLoader worker). Each shard is checked
    against the index when first opened (size and header; its checksum once per process unless
    `checksums=False`); a mismatch raises `DataError` naming the file.
    """

    def __init__(self, directory: Path, checksums: bool = True) -> None:
        self.directory = Path(directory)
        self.checksums = checksums
        with np.load(self.directory / "index.npz") as z:
            self.utt_ids: list[str] = [str(u) for u in z["utt_ids"]]
            self.shard = z["shard"].astype(np.int64)  # (N,)
            self.row = z["row"].astype(np.int64)  # (N,) row in the shard's stats
            self.offset = z["offset"].astype(np.int64)  # (N,) first frame in the shard
            self.lengths = z["length"].astype(np.int64)  # (N,) frames
        meta = json.loads((self.directory / "index.json").read_text())
        self.failures = [Skip(**f) for f in meta["failures"]]
        self.notes: list[tuple[str, str]] = [tuple(n) for n in meta["notes"]]
        self.feature_dim = int(meta["feature_dim"])
        self.audio_seconds = float(meta["audio_seconds"])
        self.files: dict[str, dict[str, Any]] = meta["files"]  # name -> size, shape, dtype, sha256
        self.num_shards = int(meta["shards"])
        self.position = {u: i for i, u in enumerate(self.utt_ids)}
        self._maps: dict[int, np.ndarray] = {}
        self._stats: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.utt_ids)

    def __contains__(self, utt_id: str) -> bool:
        return utt_id in self.position

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}, "_stats": {}}

    def damaged(self, checksums: bool) -> list[tuple[int, Path, str]]:
        """(shard, file, problem) for every file that does not match the index: sizes and
        headers always, statistics checksums always (small), feature checksums if asked."""
        bad = []
        for k in range(self.num_shards):
            for name, full in zip(_shard_files(k), (checksums, True)):
                problem = check_npy(self.directory / name, self.files[name], full, once=False)
                if problem:
                    bad.append((k, self.directory / name, problem))
        return bad

    def _checked_load(self, name: str, shard: int, mmap: bool) -> np.ndarray:
        path = self.directory / name
        problem = check_npy(path, self.files[name], self.checksums)
        if problem:
            invalidate_shard(self.directory, shard)
            raise DataError(
                path,
                "corrupt feature cache",
                f"{problem}; shard {shard} is marked for re-extraction: rerun the same command "
                f"(add data.verify_cache=true to checksum every shard before training starts)",
            )
        return np.load(path, mmap_mode="r") if mmap else np.load(path)

    def _shard(self, s: int) -> np.ndarray:
        m = self._maps.get(s)
        if m is None:
            name = _shard_files(s)[0]
            m = self._maps[s] = self._checked_load(name, s, self.files[name]["size"] > 128)
        return m

    def raw(self, i: int | str) -> np.ndarray:
        """(T, F) read-only view into the memory map, in the cache dtype (float16 by default)."""
        i = self.position[i] if isinstance(i, str) else int(i)
        start = self.offset[i]
        return self._shard(int(self.shard[i]))[start : start + self.lengths[i]]

    def features(self, i: int | str) -> np.ndarray:
        """(T, F) float32 features of utterance `i` (index or utterance id), a copy."""
        return np.asarray(self.raw(i), dtype=np.float32)

    def sums(self, indices: Sequence[int]) -> tuple[int, np.ndarray, np.ndarray]:
        """Frame count, sum and sum of squares (float64 (F,)) over the given utterances."""
        total = np.zeros(self.feature_dim)
        total_sq = np.zeros(self.feature_dim)
        count = 0
        idx = np.asarray(indices, dtype=np.int64)
        for s in np.unique(self.shard[idx]):
            stats = self._stats.get(int(s))
            if stats is None:
                k = int(s)
                stats = self._stats[k] = self._checked_load(_shard_files(k)[1], k, mmap=False)
            rows = self.row[idx[self.shard[idx] == s]]
            total += stats[rows, 0].sum(0)
            total_sq += stats[rows, 1].sum(0)
        count = int(self.lengths[idx].sum())
        return count, total, total_sq


# ----------------------------------------------------------------------------- extraction


@dataclass
class _ShardTask:
    directory: str
    shard: int
    items: list[tuple[str, str]]  # (utt_id, path)
    settings: ExtractionSettings
    total_utterances: int  # of the whole entry, to estimate the space extraction needs


@dataclass
class _ShardResult:
    shard: int
    utterances: int
    frames: int
    seconds: float
    failures: list[dict] = field(default_factory=list)


_LOGMEL: LogMel | None = None


def _logmel(cfg: FeatureConfig) -> LogMel:
    global _LOGMEL
    if _LOGMEL is None or _LOGMEL.cfg != cfg:
        _LOGMEL = LogMel(cfg)
    return _LOGMEL


class _HashingWriter:
    """A binary file that hashes what is written (np.save then streams through `write`)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.f.write(data)


def _atomic_save_npy(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Write `array` as `path` (temp file + rename); returns its integrity record."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        out = _HashingWriter(f)
        np.save(out, array)
    return {
        "size": out.size,
        "shape": list(array.shape),
        "dtype": array.dtype.str,
        "sha256": out.sha256.hexdigest(),
    }


def _disk_full(error: OSError) -> bool:
    # NumPy's tofile reports a short write as "N requested and M written", with no errno
    return error.errno in (errno.ENOSPC, errno.EDQUOT) or "requested and" in str(error)


def _extract_shard(task: _ShardTask) -> _ShardResult:
    """Decode and featurise one shard's utterances; write its three files (json last)."""
    import torch

    s = task.settings
    mel = _logmel(s.features)
    dtype = np.float16 if s.dtype == "float16" else np.float32
    min_samples = min_samples_for(s.min_frames)
    feats, stats, ids, lengths, failures, notes = [], [], [], [], [], []
    seconds = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one utterance is small; parallelism comes from processes
    try:
        for utt_id, path in task.items:
            try:
                audio = load_audio(path, s.sample_rate_policy, min_samples, utt_id)
            except DataError as e:
                failures.append(
                    {"utt_id": utt_id, "path": e.path, "problem": e.problem, "detail": e.detail}
                )
                continue
            x = mel(audio.audio).numpy()  # (T, F) float32
            stored = x.astype(dtype)
            exact = stored.astype(np.float64)  # statistics of what loading will return
            feats.append(stored)
            stats.append(np.stack([exact.sum(0), (exact**2).sum(0)]))  # (2, F)
            ids.append(utt_id)
            lengths.append(len(x))
            notes += [[utt_id, f"{path}: {n}"] for n in audio.notes]
            seconds += len(audio.audio) / 16000
    finally:
        torch.set_num_threads(threads)
    directory = Path(task.directory)
    F = s.features.dim
    arrays = {
        name: array
        for name, array in zip(
            _shard_files(task.shard),
            (
                np.concatenate(feats) if feats else np.zeros((0, F), dtype),
                np.stack(stats) if stats else np.zeros((0, 2, F)),
            ),
        )
    }
    try:
        files = {name: _atomic_save_npy(directory / name, a) for name, a in arrays.items()}
    except OSError as e:
        if not _disk_full(e):
            raise
        shard_bytes = sum(a.nbytes for a in arrays.values())
        need = shard_bytes / max(len(task.items), 1) * task.total_utterances
        free = shutil.disk_usage(directory).free
        raise DataError(
            directory,
            "feature cache device is full",
            f"writing shard {task.shard} failed ({e}); {free / 2**20:.0f} MiB free, and "
            f"extracting all {task.total_utterances} utterances needs about "
            f"{need / 2**20:.0f} MiB. Free space there or set data.cache_dir to another disk; "
            f"finished shards are kept and nothing half-written is used",
        ) from None
    index = {
        "utt_ids": ids,
        "lengths": lengths,
        "failures": failures,
        "notes": notes,
        "seconds": seconds,
        "files": files,
    }
    atomic_write_text(directory / f"shard-{task.shard:05d}.json", json.dumps(index))  # commit
    return _ShardResult(task.shard, len(task.items), int(sum(lengths)), seconds, failures)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _remove_stale_tmp(directory: Path) -> None:
    """Delete temporary files left by processes that no longer run (killed extractions)."""
    for path in directory.glob(f"*{TEMP_MARK}*"):
        m = _TMP_RE.search(path.name)
        pid = int(m.group(1)) if m else -1
        try:
            if pid > 0 and pid != os.getpid():
                os.kill(pid, 0)
                continue  # still running: someone else's file
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path.unlink(missing_ok=True)


def extract_features(
    utterances: Sequence[Utterance],
    settings: ExtractionSettings,
    cache_root: str | Path,
    issues: Issues | None = None,
    workers: int | None = None,
    shard_size: int = 64,
    progress: bool = True,
    description: str = "extracting features",
    on_shard_done: Callable[[int], None] | None = None,
    verify: bool = False,
) -> FeatureStore:
    """Cached features of `utterances`; extracts the missing or damaged shards first.

    Bad audio goes to `issues` (raise on the first under `on_error=error`, else recorded as
    skips). Resampled or down-mixed files are logged as warnings. `on_shard_done(shard)` is
    called after each shard is committed (tests use it to interrupt an extraction). A cache file
    that does not match its size, header or (statistics; with `verify` every file) checksum is
    re-extracted with a warning naming it.
    """
    issues = issues or Issues()
    key = cache_key(utterances, settings)
    directory = Path(cache_root).expanduser() / "features" / key
    store = _open_intact(directory, verify)
    if store is None:
        _build(
            utterances,
            settings,
            directory,
            issues,
            workers,
            shard_size,
            progress,
            description,
            on_shard_done,
        )
        store = FeatureStore(directory)
    for failure in store.failures:
        issues.report(
            DataError(failure.path, failure.problem, failure.detail, failure.utt_id), "audio"
        )
    _warn_notes(store.notes)
    return store


def _open_intact(directory: Path, verify: bool) -> FeatureStore | None:
    """The complete entry in `directory` if every file matches the index, else None after
    marking the damaged shards for re-extraction (an unreadable index is rebuilt)."""
    if not (directory / "index.npz").is_file():
        return None
    try:
        store = FeatureStore(directory)
    except Exception as e:  # damaged index.npz / index.json: rebuilt from the shard markers
        log.warning("feature cache: unreadable index in %s (%s); rebuilding it", directory, e)
        (directory / "index.npz").unlink(missing_ok=True)
        return None
    damaged = store.damaged(checksums=verify)
    for k, path, problem in damaged:
        log.warning("feature cache: %s: %s; re-extracting shard %d", path, problem, k)
        invalidate_shard(directory, k)
    return None if damaged else store


def _warn_notes(notes: list[tuple[str, str]], limit: int = 5) -> None:
    for _, note in notes[:limit]:
        log.warning("audio converted: %s", note)
    if len(notes) > limit:
        log.warning(
            "audio converted: %d more files (see index.json in the feature cache)",
            len(notes) - limit,
        )


def _build(
    utterances: Sequence[Utterance],
    settings: ExtractionSettings,
    directory: Path,
    issues: Issues,
    workers: int | None,
    shard_size: int,
    progress: bool,
    description: str,
    on_shard_done: Callable[[int], None] | None,
) -> None:

    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(directory)
    shards = [list(utterances[i : i + shard_size]) for i in range(0, len(utterances), shard_size)]
    settings_path = directory / "settings.json"
    if not settings_path.is_file():
        info = {
            **settings.fingerprint(),
            "utterances": len(utterances),
            "shards": len(shards),
            "shard_size": shard_size,
        }
        atomic_write_text(settings_path, json.dumps(info, indent=2))
    elif json.loads(settings_path.read_text()).get("shard_size") != shard_size:
        shard_size = int(
            json.loads(settings_path.read_text())["shard_size"]
        )  # resume with the original layout
        shards = [
            list(utterances[i : i + shard_size]) for i in range(0, len(utterances), shard_size)
        ]
    pending = [
        _ShardTask(
            str(directory), k, [(u.utt_id, str(u.path)) for u in shard], settings, len(utterances)
        )
        for k, shard in enumerate(shards)
        if not (directory / f"shard-{k:05d}.json").is_file()
    ]
    done = sum(len(s) for s in shards) - sum(len(t.items) for t in pending)
    if issues.on_error == "error":  # a shard done earlier may already hold a bad file: fail now
        for k in range(len(shards)):
            path = directory / f"shard-{k:05d}.json"
            if path.is_file() and (failed := json.loads(path.read_text())["failures"]):
                f = failed[0]
                raise DataError(f["path"], f["problem"], f["detail"], f["utt_id"])
    if pending:
        log.info(
            "%s: %d utterances in %d shards -> %s",
            description,
            len(utterances),
            len(pending),
            directory,
        )
    n_workers = min(workers or min(os.cpu_count() or 1, 8), len(pending))
    start = time.perf_counter()
    with progress_bar(len(utterances), description, progress and bool(pending)) as advance:
        advance(done)

        def commit(result: _ShardResult) -> None:
            advance(result.utterances)
            if result.failures and issues.on_error == "error":
                f = result.failures[0]
                raise DataError(f["path"], f["problem"], f["detail"], f["utt_id"])
            if on_shard_done is not None:
                on_shard_done(result.shard)

        if n_workers <= 1:
            for task in pending:
                commit(_extract_shard(task))
        else:
            method = "fork" if sys.platform.startswith("linux") else "spawn"
            with mp.get_context(method).Pool(n_workers, initializer=_init_worker) as pool:
                for result in pool.imap_unordered(_extract_shard, pending):
                    commit(result)
    if pending:
        log.info("%s: done in %.1f s", description, time.perf_counter() - start)
    _write_index(directory, len(shards), settings.features.dim)


def _write_index(directory: Path, n_shards: int, feature_dim: int) -> None:
    ids: list[str] = []
    shard, row, offset, length = [], [], [], []
    failures, notes = [], []
    files: dict[str, dict[str, Any]] = {}
    seconds = 0.0
    for k in range(n_shards):
        meta = json.loads((directory / f"shard-{k:05d}.json").read_text())
        files.update(meta["files"])
        n = len(meta["utt_ids"])
        lengths = np.asarray(meta["lengths"], dtype=np.int64)
        ids += meta["utt_ids"]
        shard.append(np.full(n, k, dtype=np.int32))
        row.append(np.arange(n, dtype=np.int32))
        offset.append(
            np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            if n
            else np.zeros(0, np.int64)
        )
        length.append(lengths)
        failures += [{**f, "stage": "audio"} for f in meta["failures"]]
        notes += meta["notes"]
        seconds += meta["seconds"]

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    meta = {
        "failures": failures,
        "notes": notes,
        "feature_dim": feature_dim,
        "audio_seconds": seconds,
        "shards": n_shards,
        "files": files,
    }
    # index.npz is renamed last: its presence marks the entry complete
    with atomic_path(directory / "index.npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(
                f,
                utt_ids=np.array(ids, dtype=str),
                shard=cat(shard),
                row=cat(row),
                offset=cat(offset),
                length=cat(length),
            )
        atomic_write_text(directory / "index.json", json.dumps(meta))

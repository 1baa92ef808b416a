"""Reading a corpus folder's cached features: `FeatureStore` over one manifest. A read is one
`os.preadv` into a fresh array from a per-process LRU of open shard files: descriptors stay
bounded whatever the corpus size, and nothing stays memory-mapped.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from speechattn.data.cache.shards import (
    DATA_KINDS,
    Record,
    ShardPaths,
    invalidate,
    owner,
    parse_header,
    read_marker,
    reader_path,
    reconcile,
    same_stat,
    shard_paths,
)
from speechattn.data.claims import host_name
from speechattn.data.config import DataConfig
from speechattn.data.errors import DataError, Skip
from speechattn.utils import atomic_write_text

DEFAULT_MAX_OPEN_SHARDS = DataConfig.max_open_shards  # documented there
HEADER_BYTES = 4096  # enough for any .npy header this cache writes (NumPy pads to 64 bytes)


class _OpenShards:
    """LRU of open shard files, path -> (fd, offset of the array data); one per process. A
    forked child keeps usable copies of the descriptors (`pread` has no shared file position),
    so DataLoader workers start warm."""

    def __init__(self, limit: int = DEFAULT_MAX_OPEN_SHARDS) -> None:
        self.limit = limit
        self.files: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.lock = threading.Lock()

    def read(
        self, path: str, opener: Callable[[str], tuple[int, int]], start: int, out: np.ndarray
    ) -> int:
        """Read `out.nbytes` bytes at `start` past the data offset of `path` into `out` (the
        bytes read); `opener(path)` opens and checks a file not open yet."""
        with self.lock:
            entry = self.files.pop(path, None)
            while len(self.files) >= max(1, self.limit):  # the limit may have shrunk
                os.close(self.files.popitem(last=False)[1][0])
            self.files[path] = entry = entry or opener(path)  # most recently used last
            fd, data_offset = entry
            if hasattr(os, "preadv"):  # straight into `out`
                return os.preadv(fd, [out], data_offset + start)
            data = os.pread(fd, out.nbytes, data_offset + start)
            out.reshape(-1).view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
            return len(data)

    def forget(self, path: str) -> None:
        with self.lock:
            entry = self.files.pop(path, None)
            if entry is not None:
                os.close(entry[0])

    def _after_fork(self) -> None:
        self.lock = threading.Lock()  # a lock held by another thread at fork time stays held


OPEN_SHARDS = _OpenShards()
_READING: set[Path] = set()  # the reader marks this process made (`register_reader`)


def register_reader(manifest: Path) -> None:
    """Mark `manifest` as read by this process until it exits: `gc` keeps all its shards while
    the process lives (`shards.reader_path`)."""
    path = reader_path(manifest, host_name(), os.getpid())
    if path in _READING:
        return
    with suppress(OSError):  # a read-only cache: nobody can gc it from here either
        path.touch()
        if not _READING:
            atexit.register(_unregister_readers)
        _READING.add(path)


def _unregister_readers() -> None:
    for path in _READING:
        if (owner(path) or ("", 0))[1] == os.getpid():  # not a forked child's inherited set
            path.unlink(missing_ok=True)
    _READING.clear()


os.register_at_fork(after_in_child=OPEN_SHARDS._after_fork)


def manifest_meta(path: Path) -> dict[str, Any]:
    """A manifest's json, once its npz is the one the json committed (size and mtime);
    `DataError` naming the file when either is missing, unreadable or they do not match."""
    npz = path.with_suffix(".npz")
    try:
        meta = json.loads(path.read_text())
        st = os.stat(npz)
        if st.st_size != meta["npz"]["size"] or st.st_mtime_ns != meta["npz"]["mtime_ns"]:
            raise ValueError(f"{npz.name} is not the file this manifest committed")
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(path, "unreadable feature cache manifest", str(e)[:200]) from None


def load_manifest(path: Path) -> tuple[dict[str, Any], Any]:
    """A manifest's json (`manifest_meta`) and its (lazily read) npz."""
    meta = manifest_meta(path)
    try:
        return meta, np.load(path.with_suffix(".npz"))
    except (OSError, ValueError) as e:
        raise DataError(path, "unreadable feature cache manifest", str(e)[:200]) from None


class FeatureStore:
    """Read access to the cached features of one corpus folder (one manifest); picklable.
    `features(i)` -> float32 (T, F), `raw(i)` the same in the cache dtype, both fresh arrays.
    A shard file is checked when a process opens it (size, mtime, .npy header); a damaged one
    is marked for re-extraction and raises `DataError` naming the file.

    Arrays (N utterances, in manifest order; each shard's utterances are consecutive):
        shard (N,) int32 index into `shard_keys`; row (N,) its row in the shard's statistics;
        offset (N,) int64 first frame in the shard; lengths (N,) int64 frames.
    """

    def __init__(
        self, manifest: str | Path, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS
    ) -> None:
        self.manifest = Path(manifest)
        meta, z = load_manifest(self.manifest)
        with z:
            self.utt_ids: list[str] = z["utt_ids"].tolist()
            self.shard = z["shard"]
            self.row = z["row"]
            self.offset = z["offset"]
            self.lengths = z["length"]
        self.folder = Path(meta["folder"])
        self.listing: str | None = meta["listing"]  # digest of the folder walk it was made for
        # the manifest is features/splits/<key>.json; its shards are features/shards/<settings key>/
        self.directory = self.manifest.parent.parent / "shards" / meta["settings_key"]
        self.shard_keys: list[str] = meta["shards"]
        self.records: dict[str, dict[str, Record]] = meta["records"]  # key -> npy/stats record
        self.failures = [Skip(**f) for f in meta["failures"]]
        self.scan_skips = [Skip(**f) for f in meta["scan_skips"]]
        self.notes: list[tuple[str, str]] = [tuple(n) for n in meta["notes"]]
        self.feature_dim = int(meta["feature_dim"])
        self.dtype = np.dtype(meta["dtype"])
        self.audio_seconds = float(meta["audio_seconds"])
        self.max_open_shards = max_open_shards
        if problem := self._index_problem():
            raise DataError(
                self.manifest,
                "feature cache index does not match its shards",
                f"{problem}; rerun the same command: the index is rebuilt from the shards",
            )

    def __len__(self) -> int:
        return len(self.utt_ids)

    def __contains__(self, utt_id: str) -> bool:
        return utt_id in self.position

    @cached_property
    def position(self) -> dict[str, int]:
        """utterance id -> index."""
        return dict(zip(self.utt_ids, range(len(self.utt_ids))))

    @property
    def num_shards(self) -> int:
        return len(self.shard_keys)

    def paths(self, k: int) -> ShardPaths:
        return shard_paths(self.directory, self.shard_keys[k])

    def raw(self, i: int | str) -> np.ndarray:
        """(T, F) features of utterance `i` (index or id) in the cache dtype (float16 by
        default), read from its shard."""
        i = self.position[i] if isinstance(i, str) else int(i)
        k = int(self.shard[i])
        out = np.empty((int(self.lengths[i]), self.feature_dim), self.dtype)
        start = int(self.offset[i]) * self.feature_dim * self.dtype.itemsize
        OPEN_SHARDS.limit = self.max_open_shards
        path = str(self.paths(k).npy)
        got = OPEN_SHARDS.read(path, lambda p: self._open(k, p), start, out)
        if got != out.nbytes:  # the file shrank after it was opened and checked
            OPEN_SHARDS.forget(path)
            self._refuse(k, Path(path), f"{got} of {out.nbytes} bytes read at {start}: truncated")
        if not np.isfinite(out).all():  # extraction never writes one: the file was changed
            OPEN_SHARDS.forget(path)
            self._refuse(k, Path(path), f"utterance {self.utt_ids[i]} holds NaN or inf values")
        return out

    def features(self, i: int | str) -> np.ndarray:
        """(T, F) float32 features of utterance `i` (index or utterance id)."""
        return self.raw(i).astype(np.float32)

    def sums(self, indices: Sequence[int]) -> tuple[int, np.ndarray, np.ndarray]:
        """Frame count, sum and sum of squares (float64 (F,)) over the given utterances (an
        index given twice counts twice). One pass: each shard's statistics are read once."""
        weight = np.bincount(np.asarray(indices, dtype=np.int64), minlength=len(self))
        weight = weight.astype(np.float64)  # (N,)
        total, total_sq = np.zeros(self.feature_dim), np.zeros(self.feature_dim)
        bounds = np.searchsorted(self.shard, np.arange(self.num_shards + 1))  # k: [b_k, b_k+1)
        for k in np.unique(self.shard[weight > 0]):
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            stats = self._statistics(int(k))[self.row[lo:hi]]  # (n, 2, F)
            total += weight[lo:hi] @ stats[:, 0]
            total_sq += weight[lo:hi] @ stats[:, 1]
        return int(weight @ self.lengths), total, total_sq

    def nbytes(self) -> int:
        """Bytes of shard files this store reads."""
        return sum(r["size"] for rec in self.records.values() for r in rec.values())

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "position"}

    def _index_problem(self) -> str | None:
        """What makes the index unfit to read with (a read would return another utterance's
        frames), or None: each shard's slice must be its marker's utterances and lengths, with
        consecutive rows and offsets adding up to the frames its features file holds."""
        N, K = len(self.utt_ids), len(self.shard_keys)
        if any(len(a) != N for a in (self.shard, self.row, self.offset, self.lengths)):
            return f"its arrays do not all have {N} entries"
        if N and (self.shard.min() < 0 or self.shard.max() >= K or np.diff(self.shard).min() < 0):
            return f"shard numbers out of order or outside 0..{K - 1}"
        bounds = np.searchsorted(self.shard, np.arange(K + 1))  # shard k: [b_k, b_k+1)
        for k, key in enumerate(self.shard_keys):
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            lengths = self.lengths[lo:hi]
            marker = read_marker(self.paths(k).marker)
            if marker is None:
                return f"shard {key} is not committed"
            if self.utt_ids[lo:hi] != marker["utt_ids"] or lengths.tolist() != marker["lengths"]:
                return f"shard {key}: utterances or lengths differ from its commit marker"
            if not np.array_equal(self.row[lo:hi], np.arange(hi - lo)):
                return f"shard {key}: statistics rows out of order"
            if not np.array_equal(self.offset[lo:hi], np.cumsum(lengths) - lengths):
                return f"shard {key}: offsets do not follow the lengths"
            shape, held = [int(lengths.sum()), self.feature_dim], self.records[key]["npy"]["shape"]
            if held != shape:
                return f"shard {key}: {shape} frames indexed, its features file holds {held}"
        return None

    def check(self, verify: bool = False) -> list[tuple[int, Path, str]]:
        """(shard, file, problem) for every data file that is not what was written (`reconcile`);
        records of files found intact under a new mtime are refreshed, here and in the manifest."""
        bad, refreshed = [], False
        for k, key in enumerate(self.shard_keys):
            paths = self.paths(k)
            for kind in DATA_KINDS:
                cached = self.records[key][kind]
                record, problem = reconcile(paths, kind, cached, verify)
                if problem:
                    bad.append((k, getattr(paths, kind), problem))
                elif record is not cached:
                    self.records[key][kind] = record
                    refreshed = refreshed or record != cached
        if refreshed:
            meta = json.loads(self.manifest.read_text())
            meta["records"] = self.records
            with suppress(OSError):  # a read-only cache: checked again next time
                atomic_write_text(self.manifest, json.dumps(meta))
        return bad

    def _refuse(self, k: int, path: Path, problem: str) -> None:
        invalidate(self.paths(k), path)
        raise DataError(
            path,
            "corrupt feature cache",
            f"{problem}; shard {self.shard_keys[k]} is marked for re-extraction: rerun the same "
            f"command (add data.verify_cache=true to checksum every shard before training starts)",
        )

    def _open(self, k: int, path: str) -> tuple[int, int]:
        """Open shard k's features for the LRU: (fd, data offset), checked against its record."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:  # other errors (EMFILE, EACCES) say nothing about the file
            self._refuse(k, Path(path), "missing")
        try:
            return fd, self._header(k, "npy", fd)[1]
        except BaseException:
            os.close(fd)
            raise

    def _header(self, k: int, kind: str, fd: int) -> tuple[Record, int]:
        """The record of shard k's `kind` file open at `fd`, and its data offset, both checked
        (the file refused when they do not match)."""
        paths, key = self.paths(k), self.shard_keys[k]
        record = self.records[key][kind]
        if not same_stat(os.fstat(fd), record):
            record, problem = reconcile(paths, kind, record, False)
            if problem:
                self._refuse(k, getattr(paths, kind), problem)
            self.records[key][kind] = record
        data_offset, problem = parse_header(os.pread(fd, HEADER_BYTES, 0), record)
        if problem:
            self._refuse(k, getattr(paths, kind), problem)
        return record, data_offset

    def _statistics(self, k: int) -> np.ndarray:
        """Shard k's (utterances, 2, F) float64 statistics, checked against their record."""
        path = self.paths(k).stats
        try:
            with open(path, "rb") as f:
                record, data_offset = self._header(k, "stats", f.fileno())
                f.seek(data_offset)
                stats = np.fromfile(f, dtype=np.dtype(record["dtype"]))
        except FileNotFoundError:
            self._refuse(k, path, "missing")
        if stats.size != int(np.prod(record["shape"])):
            self._refuse(k, path, f"{stats.size} values instead of {record['shape']}")
        stats = stats.reshape(record["shape"])
        finite = np.isfinite(stats).reshape(len(stats), -1).all(axis=1)  # (utterances,)
        if not finite.all():  # cached before decoding refused NaN/inf samples: extract again
            row = int(np.argmin(finite))
            utt = self.utt_ids[int(np.flatnonzero((self.shard == k) & (self.row == row))[0])]
            self._refuse(k, path, f"non-finite features cached for {utt}")
        return stats


def touch(manifest: Path) -> None:
    """Note that a manifest was used now (its json's mtime is the `last used` of `ls`)."""
    now = time.time()
    with suppress(OSError):
        os.utime(manifest, (now, now))

"""Checksums once: each cache file's record (size, shape, dtype, sha256, mtime_ns) is taken as
it is written; later a size + mtime match is trusted, and only a file whose size or mtime
moved is checksummed. Records live in the shard's commit marker (the source of truth) and are
copied into every manifest that uses the shard.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from speechattn.utils import atomic_path, atomic_write_text

log = logging.getLogger(__name__)

Record = dict[str, Any]  # size, shape, dtype, sha256, mtime_ns
# enough for any .npy header this cache writes (NumPy pads them to 64-byte units)
HEADER_BYTES = 4096


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class _HashingWriter:
    """A binary file that hashes what is written (np.save then streams through `write`)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.f.write(data)


def save_npy(path: Path, array: np.ndarray) -> Record:
    """Write `array` as `path` atomically; returns its record, the checksum computed from the
    bytes as they are written."""
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


def same_stat(st: os.stat_result, record: Record) -> bool:
    return st.st_size == record["size"] and st.st_mtime_ns == record["mtime_ns"]


def parse_header(head: bytes, record: Record) -> tuple[int, str | None]:
    """(offset of the array data, None) when `head` (a .npy file's first bytes) describes the
    recorded shape and dtype, else (0, what is wrong)."""
    f = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0
        if version != (1, 0):
            read = np.lib.format.read_array_header_2_0
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
    """What is wrong with a parsed commit marker (`shards.extract_shard` writes it), or None."""
    try:
        files, ids, lengths = marker["files"], marker["utt_ids"], marker["lengths"]
        records = [files[kind] for kind in ("npy", "stats")]
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


def write_marker(path: Path, marker: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(marker))


def reconcile(
    path: Path, cached: Record | None, marker_path: Path, kind: str, verify: bool
) -> tuple[Record | None, str | None]:
    """Is the data file `path` (`kind` "npy" or "stats" of the shard whose commit marker is
    `marker_path`) what was written? Returns (its current record, None) or (None, problem).

    A stat matching `cached` (a manifest's copy) or the marker is trusted; a size match under
    another mtime is checksummed, and when the bytes match the marker records the new mtime.
    `verify` checksums in every case.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:  # other errors (EACCES, EIO) say nothing about the bytes: raised
        return None, "missing"
    if not verify and cached is not None and same_stat(st, cached):
        return cached, None
    marker = read_marker(marker_path)
    if marker is None:
        return None, f"its commit marker {marker_path.name} is missing (not fully extracted)"
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
        try:
            write_marker(marker_path, marker)
        except OSError:
            pass  # a read-only cache: this file is checksummed again next time, nothing worse
    return record, None


def invalidate(marker_path: Path, damaged: Path | None = None) -> None:
    """Mark a shard as not extracted (its commit marker goes first) and delete a damaged file,
    so every manifest that uses the shard finds it missing and has it re-extracted."""
    marker_path.unlink(missing_ok=True)
    if damaged is not None:
        damaged.unlink(missing_ok=True)


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """Write `arrays` as an uncompressed `path` atomically; returns its size and mtime_ns."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        st = os.stat(tmp)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}

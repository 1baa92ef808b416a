"""Collect downstream results (`result.json`), ABX evaluations (`abx.json`) and attention
benchmarks from a results folder: any tree, the newest file per (variant, task) or variant wins,
unreadable files are noted, never fatal, so a half-finished study still gives a report.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from speechattn.tasks.records import (
    ABX_FILE,
    MEL,
    RESULT_FILE,
    TASKS,
    AbxRecord,
    DownstreamResult,
    read_abx,
    read_result,
)

T = TypeVar("T")


@dataclass
class ResultSet:
    """results[variant][task] -> the run that counts; problems are human-readable notes."""

    results: dict[str, dict[str, tuple[Path, DownstreamResult]]] = field(default_factory=dict)
    abx: dict[str, tuple[Path, AbxRecord]] = field(default_factory=dict)  # variant -> newest
    problems: list[str] = field(default_factory=list)
    superseded: list[Path] = field(default_factory=list)

    def get(self, variant: str, task: str) -> DownstreamResult | None:
        return self.results.get(variant, {}).get(task, (None, None))[1]

    def path(self, variant: str, task: str) -> Path | None:
        return self.results.get(variant, {}).get(task, (None, None))[0]

    def accuracy(self, variant: str, task: str) -> float | None:
        return getattr(self.get(variant, task), "test_accuracy", None)

    def tasks(self) -> list[str]:
        """The study's four tasks in order, then any others found."""
        found = {t for runs in self.results.values() for t in runs}
        return [*TASKS, *sorted(found - set(TASKS))]

    def variants(self) -> list[str]:
        """`mel` first, then the registry's order, then any other variants found."""
        return _in_order(set(self.results))

    def abx_variants(self) -> list[str]:
        """The variants with an `abx.json`, in the order of `variants`."""
        return _in_order(set(self.abx))


def _in_order(found: set[str]) -> list[str]:
    ordered = [MEL] + [v for v in registry_order() if v != MEL]
    return [v for v in ordered if v in found] + sorted(found - set(ordered))


def registry_order() -> list[str]:
    """Variant names in the attention registry's order ([] when it cannot be imported)."""
    try:
        from speechattn.attention import available
    except ImportError:
        return []
    return list(available())


def collect(root: str | Path) -> ResultSet:
    """Read every `result.json` and `abx.json` under `root`."""
    found = ResultSet()
    if not Path(root).is_dir():
        found.problems.append(f"{root}: results folder does not exist")
        return found
    runs, found.superseded = read_newest(
        root, RESULT_FILE, read_result, lambda r: (r.attention, r.task), found.problems
    )
    for (variant, task), entry in runs.items():
        found.results.setdefault(variant, {})[task] = entry
    found.abx, abx_superseded = read_newest(
        root, ABX_FILE, read_abx, lambda r: r.attention, found.problems
    )
    found.superseded += abx_superseded
    return found


def read_newest(
    root: str | Path,
    name: str,
    read: Callable[[Path], T],
    key: Callable[[T], Any],
    problems: list[str],
) -> tuple[dict[Any, tuple[Path, T]], list[Path]]:
    """Every file `name` under `root` read by `read`, the newest (`created`) per `key(record)`
    (ties: the later path), and the paths of the others; unreadable files go to `problems`."""
    found: dict[Any, tuple[Path, T]] = {}
    superseded: list[Path] = []
    for path in sorted(Path(root).rglob(name)):
        try:
            record = read(path)
        except ValueError as e:
            problems.append(str(e))
            continue
        previous = found.get(key(record))
        if previous is not None:
            older = record.created < previous[1].created  # type: ignore[attr-defined]
            superseded.append(path if older else previous[0])
            if older:
                continue
        found[key(record)] = (path, record)
    return found, superseded


# ----------------------------------------------------------------------------- benchmark


@dataclass
class BenchRecord:
    """One measurement: variant at sequence length T (times in ms, memory in MiB)."""

    variant: str
    seq_len: int
    time_ms: float | None = None
    memory_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:  # JSON numbers and strings, as read
        self.variant, self.seq_len = str(self.variant), int(self.seq_len)
        self.time_ms = None if self.time_ms is None else float(self.time_ms)
        self.memory_mb = None if self.memory_mb is None else float(self.memory_mb)


_NAME_KEYS = ("attention", "variant", "name")
_LEN_KEYS = ("seq_len", "T", "length", "seq_length")
_TIME_KEYS = ("time_ms", "forward_backward_ms", "train_ms", "fwd_bwd_ms", "forward_ms", "ms")
_MEM_KEYS = ("peak_memory_mb", "peak_mem_mb", "memory_mb", "peak_mb", "mem_mb")


def _first(record: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((record[key] for key in keys if record.get(key) is not None), None)


def read_bench(path: str | Path) -> tuple[list[BenchRecord], dict[str, Any]]:
    """Records and metadata of `python -m speechattn.bench attention --json PATH` output.

    Besides the benchmark's own `{"meta": {...}, "variants": {name: {"time_ms": {T: ms},
    "peak_mem_mb": {T: MiB}}}}`: a list of records, or an object with a `results` (or `records`)
    list whose other keys are metadata; a record names its variant, length, time and memory
    under any of the keys above (the first present counts), other keys go to `extra`.
    """
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("variants"), dict):
        return _read_bench_by_variant(data)
    rows, meta = data, {}
    if isinstance(data, dict):
        rows = data.get("results", data.get("records", []))
        meta = {k: v for k, v in data.items() if k not in ("results", "records")}
    used = set(_NAME_KEYS + _LEN_KEYS + _TIME_KEYS + _MEM_KEYS)
    records = []
    for row in (r for r in rows if isinstance(r, dict)):
        name, seq_len = _first(row, _NAME_KEYS), _first(row, _LEN_KEYS)
        if name is not None and seq_len is not None:
            extra = {k: v for k, v in row.items() if k not in used}
            time_ms, memory = _first(row, _TIME_KEYS), _first(row, _MEM_KEYS)
            records.append(BenchRecord(name, seq_len, time_ms, memory, extra))
    return records, meta


def _read_bench_by_variant(data: dict[str, Any]) -> tuple[list[BenchRecord], dict[str, Any]]:
    """`speechattn.bench.attention` JSON: per variant, measurements keyed by T (JSON strings)."""
    records = []
    for name, row in data["variants"].items():
        if not isinstance(row, dict):
            continue
        times, memory = row.get("time_ms") or {}, row.get("peak_mem_mb") or {}
        errors = row.get("errors") or {}
        for T in sorted({*times, *memory}, key=int):
            records.append(
                BenchRecord(name, T, times.get(T), memory.get(T), {"error": errors.get(T)})
            )
    return records, dict(data.get("meta") or {})


def find_bench(root: str | Path) -> Path | None:
    """The attention benchmark JSON in a results folder (`bench/attention.json` first)."""
    root = Path(root)
    preferred = root / "bench" / "attention.json"
    if preferred.is_file():
        return preferred
    candidates = sorted(root.glob("**/*bench*.json")) + sorted(root.glob("bench/*.json"))
    return candidates[0] if candidates else None

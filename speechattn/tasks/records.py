"""The records the jobs write and `report/` reads (`result.json`, `heads.json`,
`superb_result.json`, `abx.json`), with their readers and schema checks; free of
torch/Lightning imports so the report reads them cheaply.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypedDict, TypeVar

from speechattn.data.errors import DataError
from speechattn.errors import MissingFileError
from speechattn.utils import atomic_write_text

SCHEMA_VERSION = 1
RESULT_FILE = "result.json"
# One normalised test utterance saved beside each result, for the report's attention maps.
EXAMPLE_FILE = "example_utterance.pt"

# The four downstream tasks (docs/downstream.md), in the column order of the study's Table 2.
TASKS: tuple[str, ...] = ("speaker_utterance", "speaker_frame", "phone_1hidden", "phone_2hidden")
MEL = "mel"  # the no-pretraining baseline: upstream=mel probes the input features
T = TypeVar("T")


class _Record:
    """A dataclass written as one JSON object, `FILE` in its folder."""

    FILE: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    def write(self, directory: str | Path) -> Path:
        """Write `directory/FILE` atomically (temp file + rename); returns its path."""
        return _write_json(self.to_dict(), directory, self.FILE)


@dataclass
class DownstreamResult(_Record):
    """One downstream run: `result.json` (schema version 1), one JSON object."""

    FILE: ClassVar[str] = RESULT_FILE

    task: str  # a task of conf/task/ (the study's: TASKS)
    upstream: str  # path of the upstream.pt that was probed, or "mel"
    upstream_sha256: str | None  # sha256 of that file (null for mel)
    attention: str  # attention variant of the upstream ("mel" for the baseline)
    layer: str | int  # "last", "weighted" or an integer index into the hidden states
    dev_accuracy: float  # best dev accuracy (model selection)
    test_accuracy: float  # test accuracy of the best-dev checkpoint
    seed: int  # global seed
    code_version: str  # `speechattn.code_version()`
    split_sizes: dict[str, int]  # utterances per split {"train", "dev", "test"}
    corpus: dict[str, Any] = field(default_factory=dict)  # the data config (DataConfig fields)
    # {"name": ..., "options": {...}} as saved by pretraining ({} for mel)
    attention_config: dict[str, Any] = field(default_factory=dict)
    model_config: dict[str, Any] = field(default_factory=dict)  # the upstream's ({} for mel)
    pretraining_steps: int | None = None  # optimiser steps of the upstream (null: mel, unknown)
    upstream_parameters: int = 0  # parameter count of the upstream (0 for mel)
    pooling: str | None = None  # utterance pooling ("mean" | "fused"), null for frame tasks
    probe: dict[str, Any] = field(default_factory=dict)  # the task config (head, optimiser, ...)
    eval_frames: dict[str, int] = field(default_factory=dict)  # scored per split {"dev", "test"}
    frames_per_utterance: float = 0.0  # mean upstream frames per test utterance
    num_classes: int = 0  # classes of the probe
    best_epoch: int = 0  # epoch of the best-dev checkpoint (0-based)
    epochs_trained: int = 0  # epochs run before early stopping / max_epochs
    runtime_s: dict[str, float] = field(default_factory=dict)  # {"features", "train", "total"}
    created: str = ""  # ISO-8601 UTC time stamp
    schema_version: int = SCHEMA_VERSION


def _write_json(data: Any, directory: str | Path, name: str, indent: int = 2) -> Path:
    path = Path(directory) / name
    atomic_write_text(path, json.dumps(data, indent=indent, default=str) + "\n")
    return path


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(path, f"not a readable {what}", str(e)) from e


def _read_record(cls: type[T], path: str | Path, name: str, kind: str | None = None) -> T:
    """`cls` read from the JSON file `path` (a `name` of `kind`) after the shared checks (an
    object, its `kind`, the schema version, which a record without a kind may omit, no
    required field missing: `DataError` naming the file); newer writers' fields are ignored."""
    path = Path(path)
    data = _read_json(path, name)
    if not isinstance(data, dict):
        raise DataError(path, f"expected a JSON object, found {type(data).__name__}")
    if kind is not None and data.get("kind") != kind:
        raise DataError(path, f"not {name}", f"kind {data.get('kind')!r}, expected {kind!r}")
    version = data.get("schema_version", None if kind else SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise DataError(path, f"{name} schema version {version}, expected {SCHEMA_VERSION}")
    required = [
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    ]
    missing = [f for f in required if f not in data]
    if missing:
        raise DataError(path, f"{name} lacks required field(s) {', '.join(missing)}")
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


def read_result(path: str | Path) -> DownstreamResult:
    """Read and check one `result.json`; a clear `DataError` naming the file when it is not one."""
    result = _read_record(DownstreamResult, path, RESULT_FILE)
    for name in ("dev_accuracy", "test_accuracy"):
        value = getattr(result, name)
        if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise DataError(path, f"{name} must be a number in [0, 1], found {value!r}")
    return result


HEADS_SCHEMA_VERSION = 1
KIND = "speechattn-heads"
HEADS_FILE = "heads.json"
PRETRAIN = "pretrain"


class _HeadsRequired(TypedDict):
    task: str  # pretrain | a downstream task of conf/task/
    metric: str  # "l1_loss" (pretrain, lower is better) | "accuracy" (downstream)
    higher_is_better: bool
    base_metric: float  # metric of the unmasked model on the subset
    num_layers: int  # L (depths, one xi row each, also with shared weights)
    num_heads: int  # h
    attention: str  # attention variant of the upstream
    upstream: str  # absolute path of upstream.pt
    # {"per": "utterance"|"batch", "raw": (L, h) E|dL/dxi|, "normalized": (L, h) raw / per-depth
    # L2 norm, "signed": (L, h) E[dL/dxi], "order": [[depth, head], ...] increasing normalised}
    importance: dict[str, Any]
    # {"single" | "keep_only": {"metric": (L, h), "delta": (L, h)} or null,
    #  "layer": {"metric": (L,), "delta": (L,)} or null}; delta = metric - base
    ablation: dict[str, Any]
    # null or {"step", "recompute", "keep_one_per_layer", "points": [{"num_masked", "fraction",
    # "metric", "newly_masked": [[depth, head], ...], "mask": (L, h) 1 kept / 0 masked}, ...]}
    pruning: dict[str, Any] | None
    seed: int  # seed of the fixed reconstruction masks
    code_version: str  # `speechattn.code_version()`


class HeadsRecord(_HeadsRequired, total=False):
    """One `heads.json` (schema version 1), one JSON object; matrices are nested lists, rows =
    depths 0..L-1, columns = heads 0..h-1. JSON-shaped, so the report indexes it as a dict."""

    schema_version: int  # 1
    kind: str  # "speechattn-heads"
    attention_options: dict[str, Any]  # as saved by pretraining
    model_config: dict[str, Any]  # the upstream's model config
    upstream_sha256: str | None  # sha256 of upstream.pt
    # null (pretrain) or {"dir", "checkpoint", "layers", "dev_accuracy", "test_accuracy"} of
    # the probe's run
    downstream: dict[str, Any] | None
    split: str  # data split the subset comes from ("val" for pretrain, "dev"/"test")
    # {"batches", "utterances", "frames" (10 ms), "scored" (chosen model frames / labels),
    # "importance_units" (units averaged for importance)}
    subset: dict[str, int]
    # {"num_batches", "batch_size", "dtype", "heads": {"importance", "ablation", "pruning"}}:
    # the options the analysis ran with
    config: dict[str, Any]
    runtime_s: dict[str, float]  # {"load", "importance", "ablation", "pruning", "total"}
    created: str  # ISO-8601 UTC time stamp


REQUIRED = tuple(_HeadsRequired.__annotations__)  # checked on every read and write


def write_heads(result: HeadsRecord, directory: str | Path) -> Path:
    """Write `directory/heads.json` atomically (temp file + rename); returns its path."""
    check_heads(result, HEADS_FILE)
    return _write_json(result, directory, HEADS_FILE, indent=1)


def read_heads(path: str | Path) -> HeadsRecord:
    """Read and check one `heads.json` (or its folder); `DataError` naming it if it is not one."""
    path = Path(path)
    if path.is_dir():
        path = path / HEADS_FILE
    if not path.is_file():
        raise MissingFileError(
            f"head analysis {path} does not exist: give the heads.json (or its "
            "folder) that `python -m speechattn.analyze heads` wrote"
        )
    data = _read_json(path, HEADS_FILE)
    check_heads(data, path)
    return data


def check_heads(data: Any, path: str | Path) -> None:
    """Schema checks: kind, version, required fields and (L, h) matrix shapes."""
    if not isinstance(data, dict):
        raise DataError(path, f"expected a JSON object, found {type(data).__name__}")
    if data.get("kind") != KIND:
        raise DataError(path, f"not a head analysis (kind {data.get('kind')!r}, expected {KIND!r})")
    if data.get("schema_version") != HEADS_SCHEMA_VERSION:
        raise DataError(
            path,
            f"heads schema version {data.get('schema_version')!r}, expected {HEADS_SCHEMA_VERSION}",
        )
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise DataError(path, f"heads.json lacks required field(s) {', '.join(missing)}")
    L, h = data["num_layers"], data["num_heads"]

    def matrix(value: Any, where: str) -> None:
        ok = (
            isinstance(value, list)
            and len(value) == L
            and all(isinstance(r, list) and len(r) == h for r in value)
        )
        if not ok:
            raise DataError(path, f"{where} must be a {L} x {h} matrix (depth x head)")

    for key in ("raw", "normalized"):
        matrix(data["importance"].get(key), f"importance.{key}")
    for key in ("single", "keep_only"):
        if data["ablation"].get(key) is not None:
            matrix(data["ablation"][key].get("metric"), f"ablation.{key}.metric")
            matrix(data["ablation"][key].get("delta"), f"ablation.{key}.delta")
    if data["pruning"] is not None:
        points = data["pruning"].get("points")
        if not isinstance(points, list) or not points:
            raise DataError(path, "pruning.points must be a non-empty list")
        for i, point in enumerate(points):
            matrix(point.get("mask"), f"pruning.points[{i}].mask")


def find_heads(results_dir: str | Path) -> list[Path]:
    """Every `heads.json` under `results_dir`, sorted."""
    return sorted(Path(results_dir).rglob(HEADS_FILE))


SUPERB_FILE = "superb_result.json"
SUPERB_KIND = "speechattn-superb"
WEIGHTED_SUM = "weighted sum"


@dataclass
class SuperbResult(_Record):
    """One SUPERB evaluation through s3prl's run_downstream.py (`python -m speechattn.superb -m
    evaluate`): `superb_result.json` (schema version 1), in the experiment folder beside s3prl's
    own files."""

    FILE: ClassVar[str] = SUPERB_FILE

    task: str  # s3prl downstream: speech_commands | voxceleb1 | ctc
    # "accuracy" | "per" (phone error rate), from s3prl's prediction files of the split
    metric: str
    value: float  # the metric on `split`
    higher_is_better: bool
    split: str  # evaluated split ("test")
    upstream: str  # s3prl upstream name (-u): "speechattn" or a baseline such as fbank_no_cmvn
    upstream_ckpt: str | None  # -k path (null for baselines)
    attention: str  # attention variant of a speechattn upstream, else the upstream name
    quick: bool  # whether the --quick config was used
    steps: int  # downstream training steps of the evaluated checkpoint
    checkpoint: str  # the runner checkpoint that was evaluated
    code_version: str = ""  # `speechattn.code_version()`
    created: str = ""  # ISO-8601 UTC time stamp
    # the features the downstream read: "weighted sum" (s3prl's Featurizer over every layer)
    # or "layer N" (`-l N`)
    selection: str = WEIGHTED_SUM
    upstream_sha256: str | None = None  # of the upstream file (-k), null for baselines
    expdir: str = ""  # the experiment folder the result belongs to
    kind: str = SUPERB_KIND
    schema_version: int = SCHEMA_VERSION


def read_superb(path: str | Path) -> SuperbResult:
    """Read and check one `superb_result.json`; `DataError` naming a file that is not one."""
    result = _read_record(SuperbResult, path, SUPERB_FILE, SUPERB_KIND)
    if not isinstance(result.value, int | float) or result.value != result.value:
        raise DataError(path, f"value must be a number, found {result.value!r}")
    return result


ABX_FILE = "abx.json"
ABX_KIND = "speechattn-abx"


@dataclass
class AbxRecord(_Record):
    """One ABX evaluation: `abx.json` (schema version 1; docs/abx.md), one JSON object."""

    FILE: ClassVar[str] = ABX_FILE

    upstream: str  # path of the upstream.pt scored, or "mel"
    upstream_sha256: str | None  # sha256 of that file (null for mel)
    attention: str  # attention variant of the upstream ("mel" for the log-mel features)
    split: str  # the labelled corpus's split (train | dev | test)
    distance: str  # frame distance: angular | cosine
    frame_ms: float  # the representation's frame shift (10 for mel, 30 for the model)
    # [{"layer": 0 = input embedding .. L, "within", "across": error rates in [0, 1] (null: no
    # cell), "cells", "triplets", "phone_pairs": {"within": n, "across": n}}, ...]
    layers: list[dict[str, Any]]
    # {"total": triphones, "scored", "no_frames": items whose span holds no frame at frame_ms
    # (skipped), "utterances", "speakers"}
    items: dict[str, int] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # the job's `AbxConfig`, data resolved
    # how the input features were normalised (as in result.json's corpus)
    normalization: dict[str, Any] = field(default_factory=dict)
    code_version: str = ""
    runtime_s: dict[str, float] = field(default_factory=dict)  # {"features", "score", "total"}
    created: str = ""
    kind: str = ABX_KIND
    schema_version: int = SCHEMA_VERSION

    def errors(self, mode: str) -> dict[int, float | None]:
        """Layer -> error rate of `mode` (within | across)."""
        return {int(row["layer"]): row.get(mode) for row in self.layers}


def read_abx(path: str | Path) -> AbxRecord:
    """Read and check one `abx.json`; a `DataError` naming the file when it is not one."""
    record = _read_record(AbxRecord, path, ABX_FILE, ABX_KIND)
    for row in record.layers:
        for mode in ("within", "across"):
            value = row.get(mode) if isinstance(row, dict) else None
            if value is not None and not (isinstance(value, int | float) and 0 <= value <= 1):
                problem = f"layers: {mode} must be a number in [0, 1] or null"
                raise DataError(path, problem, repr(value))
    return record

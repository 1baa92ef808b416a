"""The `heads.json` every head analysis writes, and its reader.

Kept free of torch imports so the report can read it cheaply. Matrices are nested lists,
rows = depths 0..L-1, columns = heads 0..h-1.

Schema (version 1), one JSON object:

    schema_version    1
    kind              "speechattn-heads"
    task              pretrain | speaker_utterance | speaker_frame | phone_1hidden | phone_2hidden
    metric            "l1_loss" (pretrain, lower is better) | "accuracy" (downstream)
    higher_is_better  bool
    base_metric       metric of the unmasked model on the subset
    num_layers        L (depths, one xi row each, also with shared weights)
    num_heads         h
    attention         attention variant of the upstream
    attention_options its options as saved by pretraining
    model_config      the upstream's model config
    upstream          absolute path of upstream.pt
    upstream_sha256   sha256 of that file
    downstream        null (pretrain) or {"dir", "checkpoint", "layers", "dev_accuracy",
                      "test_accuracy"} of the probe's run
    split             data split the subset comes from ("val" for pretrain, "dev"/"test")
    subset            {"batches", "utterances", "frames" (10 ms), "scored" (chosen model
                      frames / labels), "importance_units" (units averaged for importance)}
    seed              seed of the fixed reconstruction masks
    importance        {"per": "utterance"|"batch", "raw": (L, h) E|dL/dxi|, "normalized": (L, h)
                      raw / per-depth L2 norm, "signed": (L, h) E[dL/dxi],
                      "order": [[depth, head], ...] increasing normalised importance}
    ablation          {"single" | "keep_only": {"metric": (L, h), "delta": (L, h)} or null,
                       "layer": {"metric": (L,), "delta": (L,)} or null}; delta = metric - base
    pruning           null or {"step", "recompute", "keep_one_per_layer", "points": [{"num_masked",
                      "fraction", "metric", "newly_masked": [[depth, head], ...],
                      "mask": (L, h) 1 kept / 0 masked}, ...]}
    config            {"num_batches", "batch_size", "dtype", "heads": {"importance", "ablation",
                      "pruning"}} the options the analysis ran with
    code_version      `speechattn.code_version()`
    runtime_s         {"load", "importance", "ablation", "pruning", "total"}
    created           ISO-8601 UTC time stamp
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from speechattn.utils import atomic_write_text

SCHEMA_VERSION = 1
KIND = "speechattn-heads"
HEADS_FILE = "heads.json"
PRETRAIN = "pretrain"

REQUIRED = (
    "task",
    "metric",
    "higher_is_better",
    "base_metric",
    "num_layers",
    "num_heads",
    "attention",
    "upstream",
    "importance",
    "ablation",
    "pruning",
    "seed",
    "code_version",
)


def write_heads(result: dict[str, Any], directory: str | Path) -> Path:
    """Write `directory/heads.json` atomically (temp file + rename); returns its path."""
    check_heads(result, HEADS_FILE)
    path = Path(directory) / HEADS_FILE
    atomic_write_text(path, json.dumps(result, indent=1, default=str) + "\n")
    return path


def read_heads(path: str | Path) -> dict[str, Any]:
    """Read and check one `heads.json` (or a folder holding one); `ValueError` naming the file
    when it is not one."""
    path = Path(path)
    if path.is_dir():
        path = path / HEADS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable heads.json ({e})") from e
    check_heads(data, path)
    return data


def check_heads(data: Any, path: str | Path) -> None:
    """Schema checks: kind, version, required fields and (L, h) matrix shapes."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    if data.get("kind") != KIND:
        raise ValueError(
            f"{path}: not a head analysis (kind {data.get('kind')!r}, expected {KIND!r})"
        )
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: heads schema version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{path}: heads.json lacks required field(s) {', '.join(missing)}")
    L, h = data["num_layers"], data["num_heads"]

    def matrix(value: Any, where: str) -> None:
        ok = (
            isinstance(value, list)
            and len(value) == L
            and all(isinstance(r, list) and len(r) == h for r in value)
        )
        if not ok:
            raise ValueError(f"{path}: {where} must be a {L} x {h} matrix (depth x head)")

    for key in ("raw", "normalized"):
        matrix(data["importance"].get(key), f"importance.{key}")
    for key in ("single", "keep_only"):
        if data["ablation"].get(key) is not None:
            matrix(data["ablation"][key].get("metric"), f"ablation.{key}.metric")
            matrix(data["ablation"][key].get("delta"), f"ablation.{key}.delta")
    if data["pruning"] is not None:
        points = data["pruning"].get("points")
        if not isinstance(points, list) or not points:
            raise ValueError(f"{path}: pruning.points must be a non-empty list")
        for i, point in enumerate(points):
            matrix(point.get("mask"), f"pruning.points[{i}].mask")


def find_heads(results_dir: str | Path) -> list[Path]:
    """Every `heads.json` under `results_dir`, sorted."""
    return sorted(Path(results_dir).rglob(HEADS_FILE))

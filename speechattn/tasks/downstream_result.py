"""The `result.json` every downstream run writes, and its reader.

Kept free of torch/Lightning imports so the report can read results cheaply.

Schema (version 1), one JSON object:

    schema_version    1
    task              speaker_utterance | speaker_frame | phone_1hidden | phone_2hidden
    upstream          path of the upstream.pt that was probed, or "mel"
    upstream_sha256   sha256 of that file (null for mel)
    attention         attention variant of the upstream ("mel" for the baseline)
    attention_config  {"name": ..., "options": {...}} as saved by pretraining ({} for mel)
    model_config      upstream model config ({} for mel)
    pretraining_steps optimiser steps of the upstream (null for mel or when unknown)
    upstream_parameters  parameter count of the upstream (0 for mel)
    layer             "last", "weighted" or an integer index into the hidden states
    pooling           utterance pooling ("mean" | "fused"), null for frame tasks
    probe             the task config used (head sizes, optimiser, batch size)
    corpus            the data config (DataConfig fields)
    split_sizes       utterances per split {"train", "dev", "test"}
    eval_frames       frames (or utterances) scored per split {"dev", "test"}
    frames_per_utterance  mean upstream frames per test utterance (T' at the upstream rate)
    num_classes       classes of the probe
    dev_accuracy      best dev accuracy (model selection)
    test_accuracy     test accuracy of the best-dev checkpoint
    best_epoch        epoch of the best-dev checkpoint (0-based)
    epochs_trained    epochs run before early stopping / max_epochs
    seed              global seed
    code_version      `speechattn.code_version()`
    runtime_s         {"features": ..., "train": ..., "total": ...}
    created           ISO-8601 UTC time stamp
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from speechattn.utils import atomic_write_text

SCHEMA_VERSION = 1
RESULT_FILE = "result.json"
# One normalised test utterance saved beside each result, for the report's attention maps.
EXAMPLE_FILE = "example_utterance.pt"

# The four tasks of SPEC 7, in the column order of the study's Table 2.
TASKS: tuple[str, ...] = ("speaker_utterance", "speaker_frame", "phone_1hidden", "phone_2hidden")
MEL = "mel"


@dataclass
class DownstreamResult:
    """One downstream run (see the module docstring for each field's meaning)."""

    task: str
    upstream: str
    upstream_sha256: str | None
    attention: str
    layer: str | int
    dev_accuracy: float
    test_accuracy: float
    seed: int
    code_version: str
    split_sizes: dict[str, int]
    corpus: dict[str, Any] = field(default_factory=dict)
    attention_config: dict[str, Any] = field(default_factory=dict)
    model_config: dict[str, Any] = field(default_factory=dict)
    pretraining_steps: int | None = None
    upstream_parameters: int = 0
    pooling: str | None = None
    probe: dict[str, Any] = field(default_factory=dict)
    eval_frames: dict[str, int] = field(default_factory=dict)
    frames_per_utterance: float = 0.0
    num_classes: int = 0
    best_epoch: int = 0
    epochs_trained: int = 0
    runtime_s: dict[str, float] = field(default_factory=dict)
    created: str = ""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, directory: str | Path) -> Path:
        """Write `directory/result.json` atomically (temp file + rename); returns its path."""
        path = Path(directory) / RESULT_FILE
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path


def _required_fields() -> list[str]:
    return [
        f.name
        for f in fields(DownstreamResult)
        if f.default is MISSING and f.default_factory is MISSING
    ]


def read_result(path: str | Path) -> DownstreamResult:
    """Read and check one `result.json`; a clear `ValueError` naming the file when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable result.json ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ValueError(f"{path}: result schema version {version}, expected {SCHEMA_VERSION}")
    missing = [name for name in _required_fields() if name not in data]
    if missing:
        raise ValueError(f"{path}: result.json lacks required field(s) {', '.join(missing)}")
    known = {f.name for f in fields(DownstreamResult)}
    # Fields added by newer writers are ignored, never fatal.
    result = DownstreamResult(**{k: v for k, v in data.items() if k in known})
    for name in ("dev_accuracy", "test_accuracy"):
        value = getattr(result, name)
        if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{path}: {name} must be a number in [0, 1], found {value!r}")
    return result

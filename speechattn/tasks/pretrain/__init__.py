"""Pretraining job: AALBERT by masked reconstruction (docs/pretraining.md): `module` (the
LightningModule), `data` (the resumable data order), `resume` (checkpoints, `init_from`, the
run lock), `model_card` (beside upstream.pt), `run` (what `python -m speechattn.pretrain` does).
"""

from speechattn.tasks.pretrain.data import ResumableData, SeededItems, StepBatchSampler
from speechattn.tasks.pretrain.module import (
    NonFiniteLossError,
    NonFiniteWarning,
    PretrainTask,
    export_upstream,
)
from speechattn.tasks.pretrain.run import run

__all__ = [
    "NonFiniteLossError",
    "NonFiniteWarning",
    "PretrainTask",
    "ResumableData",
    "SeededItems",
    "StepBatchSampler",
    "export_upstream",
    "run",
]

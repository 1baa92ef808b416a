"""Pretraining job: AALBERT by masked reconstruction (docs/pretraining.md).

- `module`: `PretrainTask` (LightningModule: one step, non-finite handling, upstream.pt export)
- `data`: the resumable data order (`StepBatchSampler`, `SeededItems`, `ResumableData`)
- `resume`: which checkpoint `ckpt_path` means, whether it may continue, `init_from`'s
  weights (continued pretraining), the run lock
- `model_card`: README.md + loss_curve.png beside upstream.pt
- `run`: `run(cfg)`, what `python -m speechattn.pretrain` does
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

"""`python -m speechattn.pretrain [attention=NAME] [experiment=...] [trainer=...] [overrides]`.

Pretrains AALBERT by masked reconstruction (SPEC 3) and writes a run directory:

    checkpoints/last.ckpt, checkpoints/step=NNNNNNN.ckpt   resumable Lightning checkpoints
    upstream.pt      weights + model/attention/feature config + normaliser + metadata
    README.md        model card (YAML header + how to load), loss_curve.png beside it
    metrics.csv      step, train_loss, val_loss, lr, frames_per_s, data_wait, elapsed_s
    tensorboard/     TensorBoard event files
    config.yaml      the resolved configuration (Hydra's own copy is in .hydra/)

The work is `speechattn.tasks.pretrain.run(cfg)`, which tests call directly; `main` is the
Hydra wrapper (every entry point has this shape).
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from speechattn.config import CONFIG_DIR, run_cli
from speechattn.model.upstream import NonFiniteWeightsError
from speechattn.tasks.pretrain import NonFiniteLossError, run


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="pretrain")
def main(cfg: DictConfig) -> Any:
    result = run_cli(run, cfg, errors=(NonFiniteLossError, NonFiniteWeightsError))
    return result.get("val_loss") or result.get("train_loss")  # what Hydra sweepers optimise


__all__ = ["main", "run"]

if __name__ == "__main__":
    main()

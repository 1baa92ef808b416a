"""`python -m speechattn.pretrain [attention=NAME] [experiment=...] [trainer=...] [overrides]`.

Pretrains AALBERT by masked reconstruction and writes a run directory (checkpoints/,
upstream.pt, upstream/, the model card, metrics.csv, config.yaml: docs/pretraining.md). The
work is `speechattn.tasks.pretrain.run(cfg)`, which tests call directly; `main` is the Hydra
wrapper (every entry point has this shape).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from speechattn.config import CONFIG_DIR, run_cli
from speechattn.tasks.pretrain import run

log = logging.getLogger("speechattn.pretrain")


def tiny_experiment_warning(
    cfg: DictConfig, choices: Mapping[str, Any], overrides: Sequence[str]
) -> str | None:
    """The warning for LibriSpeech under the default `experiment: tiny` (which `data=librispeech`
    alone keeps), or None: another corpus, another experiment, or `experiment=...` given."""
    data = cfg.get("data") or {}
    if data.get("corpus") != "librispeech" or choices.get("experiment") != "tiny":
        return None
    if any(o.split("=", 1)[0].lstrip("+~") == "experiment" for o in overrides):
        return None  # asked for by name
    return (
        "LibriSpeech with the default experiment=tiny: the CPU quick start (aalbert_tiny, 3 "
        "layers of 256, 800 steps of 8 utterances, trainer=cpu), not the study. For AALBERT "
        "base on train-clean-360 (batch 50, 500k steps, one GPU in bf16) add experiment=paper "
        "(docs/librispeech.md); add experiment=tiny to run the quick start without this warning"
    )


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="pretrain")
def main(cfg: DictConfig) -> Any:
    hydra_cfg = HydraConfig.get()
    warning = tiny_experiment_warning(cfg, hydra_cfg.runtime.choices, hydra_cfg.overrides.task)
    if warning:
        log.warning(warning)
    result = run_cli(run, cfg)
    return result.get("val_loss") or result.get("train_loss")  # what Hydra sweepers optimise


if __name__ == "__main__":
    main()

"""SUPERB task configs for s3prl's `run_downstream.py` (docs/superb.md).

`PAPER[task]`: the config s3prl publishes on GitHub for the task (`downstream/speech_commands/
config.yaml`, `downstream/voxceleb1/config.yaml`, `downstream/ctc/libriphone.yaml`; its wheel
ships none), the SUPERB paper's settings (Yang et al., 2021), data paths left out. `QUICK[task]`:
what makes a run finish in minutes on a CPU; its numbers are not SUPERB scores.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from speechattn.errors import ConfigError

# s3prl -d names -> the SUPERB abbreviations the recipe and the report use
ABBREVIATION = {"speech_commands": "ks", "voxceleb1": "sid", "ctc": "pr"}
# the metric s3prl writes for each task, and whether higher is better
METRIC = {
    "speech_commands": ("accuracy", True),
    "voxceleb1": ("accuracy", True),
    "ctc": ("per", False),
}

_ADAM = {"name": "TorchOptim", "torch_optim_name": "Adam"}

# what speech_commands' config sets; the other tasks differ as written
_RUNNER = {
    "total_steps": 200_000,
    "gradient_clipping": 1,
    "gradient_accumulate_steps": 1,
    "log_step": 100,
    "eval_step": 4000,
    "save_step": 1000,
    "max_keep": 1,
    "eval_dataloaders": ["dev", "test"],
}
_MEAN_POOLING = {
    "projector_dim": 256,
    "select": "UtteranceLevel",
    "UtteranceLevel": {"pooling": "MeanPooling"},
}

PAPER: dict[str, dict[str, Any]] = {
    "speech_commands": {
        "runner": _RUNNER,
        "optimizer": {**_ADAM, "lr": 1.0e-4},
        "downstream_expert": {
            "datarc": {"num_workers": 8, "batch_size": 32},
            "modelrc": _MEAN_POOLING,
        },
    },
    "voxceleb1": {
        "runner": {**_RUNNER, "gradient_accumulate_steps": 4, "log_step": 500},
        "optimizer": {**_ADAM, "lr": 1.0e-4},
        "downstream_expert": {
            "datarc": {
                "num_workers": 12,
                "train_batch_size": 8,
                "eval_batch_size": 1,
                "max_timestep": 128_000,  # 8 s training crops
            },
            "modelrc": _MEAN_POOLING,
        },
    },
    "ctc": {
        "runner": {
            **_RUNNER,
            "total_steps": 100_000,
            "gradient_accumulate_steps": 2,
            "eval_step": 1000,
            "save_step": 100,
            "eval_dataloaders": ["dev"],
        },
        "optimizer": {**_ADAM, "lr": 1.0e-2},
        "downstream_expert": {
            "corpus": {
                "name": "libriphone",
                "train": "train.csv",
                "dev": "dev.csv",
                "test": "test.csv",
                "bucketing": True,
                "batch_size": 16,
                "num_workers": 24,
            },
            "text": {"mode": "word"},
            "model": {"project_dim": 256, "zero_infinity": True, "select": "FrameLevel"},
            "save_best_on": ["dev"],
            "metric_higher_better": False,
            "metric": ["per"],
        },
    },
}

# dotted key -> value, applied over PAPER[task]; every quick run trains a few hundred steps
# and is evaluated (and saved) at the end
_QUICK_RUNNER = {
    "runner.total_steps": 300,
    "runner.log_step": 50,
    "runner.eval_step": 300,
    "runner.save_step": 300,
}
QUICK: dict[str, dict[str, Any]] = {
    "speech_commands": {
        **_QUICK_RUNNER,
        "runner.eval_dataloaders": ["dev"],
        "optimizer.lr": 1.0e-3,
        "downstream_expert.datarc.num_workers": 0,
        "downstream_expert.datarc.batch_size": 16,
    },
    "voxceleb1": {
        **_QUICK_RUNNER,
        "runner.gradient_accumulate_steps": 1,
        "runner.eval_dataloaders": ["dev"],
        "optimizer.lr": 1.0e-3,
        "downstream_expert.datarc.num_workers": 0,
        "downstream_expert.datarc.max_timestep": 48_000,  # 3 s training crops
    },
    "ctc": {
        **_QUICK_RUNNER,
        "runner.gradient_accumulate_steps": 1,
        "downstream_expert.corpus.batch_size": 8,
        "downstream_expert.corpus.num_workers": 0,
    },
}


def task_config(
    task: str, quick: bool = False, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The s3prl config of `task` (PAPER, QUICK applied if `quick`), dotted `overrides` last."""
    if task not in PAPER:
        raise ConfigError(
            f"-d {task}: speechattn ships SUPERB configs for {', '.join(PAPER)}; "
            f"for other s3prl tasks pass their config with -c"
        )
    config = OmegaConf.create(PAPER[task])  # a copy
    for key, value in {**(QUICK[task] if quick else {}), **(overrides or {})}.items():
        OmegaConf.update(config, key, value, merge=False)  # intermediate dicts created
    return OmegaConf.to_container(config)

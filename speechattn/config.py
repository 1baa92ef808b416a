"""The one source of configuration: typed dataclasses registered as Hydra structured configs.
The YAML files in `conf/` select one as their schema (`defaults: [/schema/<name>@_here_,
_self_]`, the names of `SCHEMAS`) and state only what differs, so a misspelt or mistyped
override fails at composition. `attention/` options are checked by the registry when the model
is built; `trainer/` and `logger/` are `_target_` subtrees instantiated as they stand.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import MISSING, DictConfig

from speechattn import CONFIG_DIR
from speechattn.data.config import DataConfig
from speechattn.errors import SpeechattnError, command_line_errors, one_line, traceback_requested
from speechattn.model.aalbert import ModelConfig
from speechattn.model.masking import MaskingConfig
from speechattn.model.optim import OptimConfig
from speechattn.tasks.abx.run import AbxConfig
from speechattn.tasks.analysis.prune import PruneConfig
from speechattn.tasks.analysis.sources import HeadsRunConfig
from speechattn.tasks.downstream.run import TaskConfig
from speechattn.utils import link_error


@dataclass
class PretrainModelConfig:
    """The `model` group: the network, its masked-reconstruction objective and optimiser."""

    name: str = "aalbert_base"  # recorded in upstream.pt and the model card
    net: ModelConfig = field(default_factory=ModelConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    optimizer: OptimConfig = field(default_factory=OptimConfig)
    # torch.compile the training step's masked reconstruction (`tasks/pretrain/compiled.py`)
    compile: bool = False
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune | ...


@dataclass
class AttentionGroupConfig:
    """The `attention` group: a variant, its options (`conf/attention/<name>.yaml`) and how
    its kernel is chosen where it has two exact ones (`speechattn.attention.autotune`)."""

    name: str = MISSING  # the group option chosen, e.g. attention=ldsa
    options: dict[str, Any] = field(default_factory=dict)  # checked by attention.build
    # time both kernels once per length bucket on this machine (cached) and run the faster;
    # false: the `short_path_max_t` crossovers measured on one host (a module built in code)
    autotune: bool = True


@dataclass
class CheckpointConfig:
    every_n_steps: int = 200  # periodic checkpoints/step=NNNNNNN.ckpt (plus last.ckpt)
    keep: int = 3  # periodic checkpoints kept (newest); -1 keeps all


@dataclass
class PreemptionConfig:
    """SIGTERM/SIGUSR1/SIGUSR2 during training: the step finishes, checkpoints/last.ckpt is
    written, the process exits with 128 + the signal's number (docs/preemption.md)."""

    # under SLURM, SIGUSR1/SIGUSR2 also run `scontrol requeue <job>` (never SIGTERM)
    requeue: bool = True


@dataclass
class PretrainConfig:
    """`python -m speechattn.pretrain`: its groups and its own keys."""

    data: Any = None  # DataConfig, or any DataModule given by `_target_` (tests: synthetic data)
    # {name, options, autotune}: a variant of speechattn.attention.available()
    attention: AttentionGroupConfig = field(default_factory=AttentionGroupConfig)
    model: Any = None  # PretrainModelConfig
    trainer: Any = None  # lightning.pytorch.Trainer arguments (`_target_`)
    logger: Any = field(default_factory=dict)  # name -> logger `_target_`; {} = metrics.csv only
    seed: int = 1234  # model init, data order, masks and dropout all derive from it
    ckpt_path: str | None = None  # null | last (the run dir's newest checkpoint) | PATH.ckpt
    # continued pretraining: a new run from this upstream's weights (docs/upstream.md)
    init_from: str | None = None
    # settings a resume may change against its checkpoint, e.g. [model.optimizer.lr], each
    # recorded as resume_changes (docs/preemption.md)
    allow_resume_changes: list[str] = field(default_factory=list)
    output_dir: str | None = "${hydra:runtime.output_dir}"
    max_nonfinite: int = 5  # abort after this many non-finite losses/gradients in a row
    progress_bar: str = "rich"  # rich | tqdm | none
    validate_at_start: bool = True  # val_loss of the untrained model first (step 0 of metrics.csv)
    license: str = "mit"  # stated in the model card; e.g. cc-by-4.0 for LibriSpeech
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)


@dataclass
class EarlyStoppingConfig:
    patience: int = "${task.patience}"  # type: ignore[assignment]  # epochs without a better dev accuracy


@dataclass
class DownstreamConfig:
    """`python -m speechattn.downstream`: its groups and its own keys."""

    data: Any = None  # DataConfig
    task: Any = None  # TaskConfig
    upstream: str = "mel"  # an upstream.pt from `python -m speechattn.pretrain`, or `mel`
    layer: Any = "last"  # last | weighted (learned softmax mix of all layers) | index (0 = input)
    seed: int = 0
    tolerance: int = "${data.label_tolerance}"  # type: ignore[assignment]  # 10 ms frames labels may differ from the repeated features
    device: str = "auto"  # feature extraction device: auto | cpu | cuda
    # upstream: as the upstream was pretrained; corpus: as data.normalization says (a mismatch
    # logged and recorded in result.json)
    normalization: str = "upstream"
    # frozen features are cached, keyed by upstream file hash + layers + data config + statistics
    cache_dir: str | None = None  # null: <data cache root>/downstream
    output_dir: str | None = None  # null: the Hydra run dir
    trainer: Any = None  # lightning.pytorch.Trainer arguments (`_target_`, conf/trainer/probe.yaml)
    # name -> logger `_target_`; {} = logs/metrics.csv only
    logger: Any = field(default_factory=dict)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)


SCHEMAS: dict[str, Any] = {
    "pretrain": PretrainConfig,
    "downstream": DownstreamConfig,
    "analyze": HeadsRunConfig,
    "prune": PruneConfig,
    "abx": AbxConfig,
    "data": DataConfig,
    "model": PretrainModelConfig,
    "task": TaskConfig,
}


def register() -> None:
    """Store the schemas in Hydra's ConfigStore under `schema/` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        store.store(group="schema", name=name, node=node)
    # each variant's options with its config's defaults: overridable without a `+`
    from speechattn.attention import available
    from speechattn.attention.registry import options

    for name in available():
        node = {"name": name, "options": options(name)}
        store.store(group="schema/attention", name=name, node=node)
    # the model presets' networks: experiment files take them from here
    from speechattn.model.aalbert import PRESETS

    for name, net in PRESETS.items():
        store.store(group="schema/preset", name=name, node=net)


def compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    """`conf/<config_name>.yaml` composed with `overrides`, as its `@hydra.main` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides or []))


def run_cli(run: Callable[[DictConfig], dict[str, Any]], cfg: DictConfig) -> dict[str, Any]:
    """`run(cfg)` for a Hydra command line: a `SpeechattnError` ends the process with one line
    and exit status 1 (docs/errors.md); raised on with `HYDRA_FULL_ERROR=1`, or in a multirun,
    where Hydra marks the job failed and goes on (an exit would end the whole sweep)."""
    try:
        return run(cfg)
    except SpeechattnError as e:
        logging.getLogger(run.__module__).error("%s", one_line(e))
        multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
        if multirun or traceback_requested():
            raise
        sys.exit(1)


class RunFolderGuard(Callback):
    """A Hydra callback every entry point's config lists: refuses, before Hydra writes
    anything, a run folder (a multirun: its sweep's job folders) where a file that Hydra or
    the job writes is a symbolic link, which Hydra would write through."""

    # Hydra's files; pretraining's config.yaml and metrics.csv; the probes' CSV logger's
    WRITTEN = (
        ".hydra",
        ".hydra/config.yaml",
        ".hydra/hydra.yaml",
        ".hydra/overrides.yaml",
        "config.yaml",
        "metrics.csv",
        "logs",
        "logs/metrics.csv",
        "logs/hparams.yaml",
    )

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check([Path(config.hydra.run.dir)], config.hydra.job.name)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        self._check(sorted(sweep.iterdir()) if sweep.is_dir() else [], config.hydra.job.name)

    def _check(self, folders: list[Path], job: str) -> None:
        with command_line_errors(prog=f"speechattn.{job}"):
            for folder in folders:
                for name in (*self.WRITTEN, f"{job}.log"):
                    if (folder / name).is_symlink():
                        raise link_error(folder / name)


register()

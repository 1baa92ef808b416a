"""The one source of configuration: typed dataclasses registered as Hydra structured configs.

Every setting has its default in exactly one dataclass. The YAML files in `conf/` select one
of them as their schema (`defaults: [/schema/<name>@_here_, _self_]`, the names of `SCHEMAS`)
and state only what differs, so code defaults, YAML and the command line cannot disagree and a
misspelt or mistyped override fails at composition. `attention/` options stay untyped here
(`AttentionGroupConfig.options`): the registry checks them against each variant's own config
when the model is built (`speechattn.attention.build`). `trainer/` and `logger/` are
`_target_` subtrees instantiated as they stand (lightning-hydra-template's way).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
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

# ----------------------------------------------------------------------------- pretrain


@dataclass
class PretrainModelConfig:
    """The `model` group: the network, its masked-reconstruction objective and optimiser."""

    name: str = "aalbert_base"  # recorded in upstream.pt and the model card
    net: ModelConfig = field(default_factory=ModelConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    optimizer: OptimConfig = field(default_factory=OptimConfig)
    # torch.compile the training step's masked reconstruction (embedding, encoder, head, L1;
    # `tasks/pretrain/compiled.py`): one graph per (batch size, length bucket, padded or not)
    compile: bool = False
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune | ...


@dataclass
class AttentionGroupConfig:
    """The `attention` group: a variant, its options (`conf/attention/<name>.yaml`) and how
    its kernel is chosen where it has two exact ones (`speechattn.attention.autotune`)."""

    name: str = MISSING  # the group option chosen, e.g. attention=ldsa
    options: dict[str, Any] = field(default_factory=dict)  # checked by attention.build
    # Time both kernels once per length bucket on this machine (cached on disk) and run the
    # faster; false: the `short_path_max_t` crossovers measured on one AMD EPYC host. On for
    # runs, which last hours and meet hosts (GPUs, other CPUs) whose crossovers differ; a
    # module built in code keeps the rule (tests, one-off calls: no first-call pause).
    autotune: bool = True


@dataclass
class CheckpointConfig:
    every_n_steps: int = 200  # periodic checkpoints/step=NNNNNNN.ckpt (plus last.ckpt)
    keep: int = 3  # periodic checkpoints kept (newest); -1 keeps all


@dataclass
class PreemptionConfig:
    """SIGTERM/SIGUSR1/SIGUSR2 during training (docs/preemption.md): the step in progress
    finishes, checkpoints/last.ckpt is written, the process exits with 128 + the signal's number."""

    # Under SLURM (SLURM_JOB_ID set), SIGUSR1 (`sbatch --signal=USR1@90`) or SIGUSR2 (what
    # hydra/launcher=slurm's jobs ask for) also runs `scontrol requeue <job>`; the requeued job reruns its command, so give it a fixed run directory and
    # ckpt_path=last (hydra.run.dir=.../slurm-$SLURM_JOB_ID). SIGTERM never requeues: it is
    # also what `scancel` sends, and SLURM's own preemption requeues by itself.
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
    # continued pretraining: a new run (step 0, new optimiser) from the weights of this
    # upstream.pt or upstream folder; same architecture and features (docs/upstream.md)
    init_from: str | None = None
    # settings a resume may change against its checkpoint, e.g. [model.optimizer.lr]; others
    # that differ are refused. Each change is logged and recorded in upstream.pt's metadata
    # (resume_changes); model.optimizer.name never changes (docs/preemption.md)
    allow_resume_changes: list[str] = field(default_factory=list)
    output_dir: str | None = "${hydra:runtime.output_dir}"
    max_nonfinite: int = 5  # abort after this many non-finite losses/gradients in a row
    progress_bar: str = "rich"  # rich | tqdm | none
    validate_at_start: bool = True  # val_loss of the untrained model first (step 0 of metrics.csv)
    license: str = "mit"  # stated in the model card; e.g. cc-by-4.0 for LibriSpeech
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)


# ----------------------------------------------------------------------------- downstream


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
    # upstream: features normalised as the upstream was pretrained (its own mode and statistics,
    # whatever data.normalization says); corpus: as data.normalization says, a mismatch with the
    # upstream logged and recorded in result.json (corpus.normalization)
    normalization: str = "upstream"
    # frozen features are cached, keyed by upstream file hash + layers + data config + statistics
    cache_dir: str | None = None  # null: <data cache root>/downstream
    output_dir: str | None = None  # null: the Hydra run dir
    trainer: Any = None  # lightning.pytorch.Trainer arguments (`_target_`, conf/trainer/probe.yaml)
    # name -> logger `_target_`; {} = logs/metrics.csv only
    logger: Any = field(default_factory=dict)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)


# ----------------------------------------------------------------------------- registry

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
    # Each attention variant's options with the defaults of its config dataclass, which
    # conf/attention/<name>.yaml extends: the YAML states only what differs, and every option
    # can be overridden (attention.options.k=16) without a `+`.
    from speechattn.attention import available
    from speechattn.attention.registry import options

    for name in available():
        node = {"name": name, "options": options(name)}
        store.store(group="schema/attention", name=name, node=node)
    # the model presets' networks (`model.aalbert.PRESETS`): experiment files take them from
    # here, so that Python and the command line build one model
    from speechattn.model.aalbert import PRESETS

    for name, net in PRESETS.items():
        store.store(group="schema/preset", name=name, node=net)


def compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    """`conf/<config_name>.yaml` composed with `overrides`, as its entry point's `@hydra.main`
    would (for tests and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides or []))


def run_cli(run: Callable[[DictConfig], dict[str, Any]], cfg: DictConfig) -> dict[str, Any]:
    """`run(cfg)` for a Hydra command line: a `SpeechattnError` (bad input or settings, a
    diverged run) ends the process with one clear line and exit status 1 instead of a
    traceback; any other exception is a bug and keeps its traceback. `HYDRA_FULL_ERROR=1`
    keeps the traceback of a SpeechattnError too (Hydra prints it; docs/errors.md). In a
    multirun (`-m`) the error is logged and raised instead: Hydra records that job as failed
    and goes on with the others (an exit would end the whole sweep, or lose a submitit job's
    result), then ends the sweep with status 1."""
    try:
        return run(cfg)
    except SpeechattnError as e:
        logging.getLogger(run.__module__).error("%s", one_line(e))
        if _in_multirun() or traceback_requested():
            raise
        sys.exit(1)


class RunFolderGuard(Callback):
    """A Hydra callback every entry point's config lists: refuses, before Hydra writes
    anything, a run folder in which a file that Hydra or the job writes is a symbolic link:
    Hydra saves `.hydra/*.yaml` and its log by opening them, through any link planted there
    (an overwrite outside the folder). A multirun checks the existing job folders of its sweep
    folder. The job's own writes never follow links either (`speechattn.utils`: atomic
    renames, `append_text`)."""

    # Hydra's files; pretraining's config.yaml and metrics.csv; the probes' CSV logger's
    WRITTEN = (".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml",
               "config.yaml", "metrics.csv", "logs", "logs/metrics.csv", "logs/hparams.yaml")  # fmt: skip

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


def _in_multirun() -> bool:
    """True inside a job of a Hydra multirun (any launcher)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


register()

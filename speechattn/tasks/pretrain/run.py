"""`run(cfg)`: pretrain AALBERT as configured and write the run directory.

The shape every job's run has: build the data, the task, the trainer (instantiated from the
config), fit, write the results. `python -m speechattn.pretrain` is its Hydra wrapper.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import warnings
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from speechattn.attention import autotune
from speechattn.data import DataConfig, build_datamodule
from speechattn.data.features import FeatureConfig
from speechattn.errors import MissingFileError, is_int, is_number, require
from speechattn.model.aalbert import ModelConfig
from speechattn.model.masking import MaskingConfig
from speechattn.model.optim import OptimConfig
from speechattn.model.serialization import TorchFileError, load_torch_file
from speechattn.tasks.common import (
    DataWait,
    MetricsCSV,
    configured_loggers,
    finish_loggers,
    progress_bar,
    quiet_library_notices,
    read_metrics,
)
from speechattn.tasks.preemption import (
    AtomicCheckpointIO,
    StopOnSignal,
    TrainingStopped,
    remove_partial_checkpoints,
)
from speechattn.tasks.pretrain.data import ResumableData
from speechattn.tasks.pretrain.init_from import check_resume as check_init_resume
from speechattn.tasks.pretrain.init_from import init_from_upstream
from speechattn.tasks.pretrain.model_card import write_run_upstream
from speechattn.tasks.pretrain.module import PretrainTask
from speechattn.tasks.pretrain.resume import (
    RunLock,
    RunLockGuard,
    check_resume_settings,
    check_state_dict,
    checkpoint_step,
    newest_checkpoint,
    override,
    resume_differences,
)
from speechattn.utils import atomic_write_text, plain

log = logging.getLogger("speechattn.pretrain")


def run(cfg: DictConfig, datamodule: Any = None) -> dict[str, Any]:
    """Pretrain as configured; returns final metrics and paths.

    `datamodule` replaces the data layer's PretrainDataModule (tests pass synthetic data);
    it must follow the batch contract of docs/ARCHITECTURE.md.
    """
    quiet_library_notices()
    check_settings(cfg)
    output_dir = Path(cfg.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    # one run per run directory; under DDP the launched ranks run this too: rank 0 holds it
    # (rank_zero_only.rank is read from the launcher's environment, right before connecting)
    with RunLock(output_dir) if rank_zero_only.rank == 0 else nullcontext() as lock:
        return run_locked(cfg, datamodule, output_dir, lock)


def run_locked(
    cfg: DictConfig, datamodule: Any, output_dir: Path, lock: RunLock | None = None
) -> dict[str, Any]:
    """`run`, in the run directory `output_dir` that this process holds (`lock`; None on the
    other DDP ranks, which write nothing there)."""
    resume = resolve_ckpt_path(cfg.get("ckpt_path"), output_dir)
    checkpoint = check_resume_checkpoint(resume) if resume is not None else None
    resume_step = int(checkpoint["global_step"]) if checkpoint is not None else 0
    changes: list[dict[str, Any]] = []
    init_from = cfg.get("init_from") or None
    if init_from is not None and checkpoint is not None:  # resume only the run it started
        check_init_resume(init_from, checkpoint, resume)
    if checkpoint is not None:
        today = {
            "model": plain(cfg.model.net),
            "masking": plain(cfg.model.masking),
            "optimizer": plain(cfg.model.optimizer),
            "seed": cfg.seed,
        }
        differences = resume_differences(checkpoint, resume, today, plain(cfg.get("data")) or {})
        allowed = [str(s) for s in cfg.get("allow_resume_changes") or []]
        changes = check_resume_settings(differences, allowed, resume, resume_step)
    warn_if_requeued_from_scratch(resume, output_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    # data
    inner = datamodule if datamodule is not None else build_datamodule(cfg.data, "pretrain")
    # task: the model gets the data's feature dim; the saved config.yaml records it
    cfg.model.net.feature_dim = int(inner.feature_dim)
    task = PretrainTask(
        model=plain(cfg.model.net),
        masking=plain(cfg.model.masking),
        optimizer=plain(cfg.model.optimizer),
        total_steps=int(cfg.trainer.max_steps),
        seed=cfg.seed,
        max_nonfinite=cfg.max_nonfinite,
        compile=bool(cfg.model.get("compile", False)),
        compile_mode=str(cfg.model.get("compile_mode", "default")),
    )
    # the training loader stacks and masks as the task defines it (settings flow down)
    data = ResumableData(inner, seed=cfg.seed, batch_masker=task.batch_masker)
    if checkpoint is not None:  # weights that do not fit: say so before Lightning loads them
        check_state_dict(checkpoint, resume, task)
        task.resume_changes = changes
        del checkpoint  # Lightning reads the file again in fit
    # two-kernel variants time both kernels per length bucket (config.AttentionGroupConfig;
    # its default where a config was built without the schema)
    autotune.enable(task.model, bool(cfg.attention.get("autotune", True)))
    data_config = plain(cfg.get("data")) or {}
    if "max_frames" in data_config:  # the data layer crops to it; fail now, not at a long batch
        task.model.check_input_frames(data_config["max_frames"], "data.max_frames")
    features = feature_config(inner, data_config)
    if init_from is not None and checkpoint is None:  # continued pretraining: a new run
        normalization = data_config.get("normalization")  # None: a datamodule of the caller's
        parent = init_from_upstream(task.model, init_from, features, normalization)
        task.set_data_info(init_from=parent)
        log.info("starting from the weights of %s (sha256 %s)", parent["path"], parent["sha256"])
    task.set_data_info(
        feature_config=features,
        corpus=str(data_config.get("corpus", type(inner).__name__)),
        data_config=data_config,
        model_name=str(cfg.model.get("name", "")),
    )
    # trainer
    preemption = cfg.get("preemption") or {}  # config.PreemptionConfig
    stop = StopOnSignal(output_dir / "checkpoints", requeue=bool(preemption.get("requeue", True)))
    trainer = build_trainer(cfg, output_dir, stop, guard=RunLockGuard(lock) if lock else None)
    # Under DDP the launched processes run this function too; rank_zero_only.rank is read from
    # the launcher's environment, so it is right before the processes are connected.
    hint = resume_hint(output_dir)
    if rank_zero_only.rank == 0:
        atomic_write_text(output_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        log.info("run directory: %s", output_dir)
        remove_partial_checkpoints(output_dir / "checkpoints")
        if resume is None:
            log.info("resume after a crash with: %s", hint)
            (output_dir / "metrics.csv").unlink(missing_ok=True)  # a fresh run, a fresh file
        else:
            log.info("resuming from %s", resume)

    # fit; SIGTERM/SIGUSR1 end it after the step in progress, with checkpoints/last.ckpt
    ckpt_path = str(resume) if resume else None
    earlier = earlier_result(output_dir) if resume and rank_zero_only.rank == 0 else None
    try:
        with stop.handling_signals(trainer, hint):
            if resume is None and cfg.get("validate_at_start", True) and trainer.limit_val_batches:
                # the untrained model's val_loss: the starting point of the curve in metrics.csv
                trainer.validate(task, datamodule=data, verbose=False)
                stop.check()
            elif resume is not None and validation_missed(trainer, resume_step, output_dir):
                # the run stopped between this step's checkpoint and the end of its validation,
                # which fit skips on resume (Lightning counts it as done): run it here, on the
                # checkpoint's weights, so metrics.csv reads as one uninterrupted run
                log.info("repeating the validation at step %d that the stop cut short", resume_step)
                metrics = metrics_csv(trainer)
                metrics.step_override = resume_step
                try:
                    trainer.validate(
                        task, datamodule=data, ckpt_path=ckpt_path, verbose=False, weights_only=True
                    )
                finally:
                    metrics.step_override = None
                stop.check()
            trainer.fit(task, datamodule=data, ckpt_path=ckpt_path, weights_only=True)
            every = trainer.val_check_interval
            if trainer.limit_val_batches and isinstance(every, int) and trainer.global_step % every:
                # the curve in metrics.csv and upstream.pt's val_loss describe the final weights
                trainer.validate(task, datamodule=data, verbose=False)
        # results
        if lock is not None:
            lock.check()  # upstream.pt and its card: this run's folder still
        return write_results(trainer, task, output_dir, license=str(cfg.get("license") or "mit"))
    except BaseException as error:  # a stop, a divergence, a crash
        if earlier is not None:  # never let the earlier run's file pass for this one's
            note = f"{earlier}; this run has no result until it is resumed and finishes"
            log.warning("%s", note)
            if isinstance(error, TrainingStopped):
                error.message += f". {note}"
        raise
    finally:
        finish_loggers(trainer.loggers)


def earlier_result(output_dir: Path) -> str | None:
    """What a resumed run must not pass off as its own: the upstream.pt (and model card) an
    earlier finish of this run directory left, described with its step; None when absent."""
    upstream = output_dir / "upstream.pt"
    if not upstream.is_file():
        return None
    try:  # memory-mapped: reads the metadata, not the weights
        meta = torch.load(upstream, map_location="cpu", weights_only=True, mmap=True)["metadata"]
        step = f"at step {int(meta['steps'])}"
    except Exception:  # unreadable: it is still not this run's result
        step = "of unknown step"
    what = (
        f"{upstream} (and README.md, its model card) is an earlier result of this run "
        f"directory, {step}"
    )
    log.warning("%s: it stays until this run finishes and replaces it", what)
    return what


def check_settings(cfg: DictConfig) -> None:
    """Refuse, before any data is read, the run-level settings that make a run do nothing or
    fail later (`ConfigError` naming the setting, its value and its valid range). The groups'
    own settings are checked by their dataclasses (DataConfig, ModelConfig, ...) as they are
    built."""
    trainer = cfg.trainer
    for name in ("max_steps", "accumulate_grad_batches", "log_every_n_steps"):
        value = trainer.get(name, 1)
        # max_steps: 0 trains nothing; Lightning's -1 (no limit) leaves the lr schedule no end
        require(is_int(value) and value >= 1, f"trainer.{name}", value, "an integer >= 1")
    every = trainer.get("val_check_interval", 1.0)
    ok = (is_int(every) and every >= 1) or (isinstance(every, float) and 0 < every <= 1)
    rule = "an integer >= 1 (steps) or a fraction in (0, 1] of an epoch"
    require(ok, "trainer.val_check_interval", every, rule)
    limit = trainer.get("limit_train_batches", 1.0)
    ok = is_number(limit) and limit > 0
    require(ok, "trainer.limit_train_batches", limit, "> 0 (0 trains nothing)")
    # the groups' dataclasses check their own settings as they are built: build them now,
    # before the corpus is read or extracted (the model gets its feature_dim from the data)
    data = cfg.get("data")
    if data is not None and "_target_" not in data:  # tests and custom corpora bring their own
        DataConfig(**plain(data))
    ModelConfig(**plain(cfg.model.net))
    MaskingConfig(**plain(cfg.model.masking))
    OptimConfig(**plain(cfg.model.optimizer))
    every_n = cfg.checkpoint.every_n_steps
    require(
        is_int(every_n) and every_n >= 1, "checkpoint.every_n_steps", every_n, "an integer >= 1"
    )
    keep = cfg.checkpoint.keep
    require(is_int(keep) and keep >= -1, "checkpoint.keep", keep, "an integer >= 0, or -1 (all)")
    limit = cfg.max_nonfinite
    require(is_int(limit) and limit >= 1, "max_nonfinite", limit, "an integer >= 1")
    bar = cfg.get("progress_bar", "rich")
    require(bar in ("rich", "tqdm", "none", None), "progress_bar", bar, "rich, tqdm or none")


def build_trainer(
    cfg: DictConfig, output_dir: Path, *extra_callbacks: L.Callback, guard: L.Callback | None = None
) -> L.Trainer:
    """`cfg.trainer` instantiated with the run's checkpoints (written atomically), metrics.csv,
    bar, loggers and `extra_callbacks`; `guard` runs before every other callback (the run
    lock's check before any write)."""
    keep = int(cfg.checkpoint.keep)
    periodic = ModelCheckpoint(
        dirpath=output_dir / "checkpoints",
        filename="step={step:07d}",
        auto_insert_metric_name=False,
        every_n_train_steps=int(cfg.checkpoint.every_n_steps),
        save_top_k=keep,
        monitor="step" if keep != -1 else None,
        mode="max",
        save_last=True,
        save_on_train_epoch_end=False,
        # overwrite, never `last-v1.ckpt`: in a copied or moved run directory Lightning would
        # not take last.ckpt for its own and write beside it (newest_checkpoint finds either)
        enable_version_counter=False,
    )
    bar = cfg.get("progress_bar", "rich")
    # a bar refresh reads train_loss from the device: once per log interval off the CPU
    refresh = 1 if cfg.trainer.accelerator == "cpu" else int(cfg.trainer.log_every_n_steps)
    metrics = MetricsCSV(output_dir / "metrics.csv", cfg.trainer.log_every_n_steps)
    callbacks = [*([guard] if guard else []), periodic, metrics, DataWait(), *extra_callbacks]
    loggers = configured_loggers(cfg)
    return instantiate(
        cfg.trainer,
        precision=resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator),
        callbacks=[*callbacks, *progress_bar(bar, refresh)],
        logger=loggers or False,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=str(output_dir),
        enable_progress_bar=bar not in ("none", None),
        _convert_="all",
    )


def validation_missed(trainer: L.Trainer, step: int, output_dir: Path) -> bool:
    """Whether `fit` validates after `step` (every `val_check_interval` steps) and the
    metrics.csv of a run resumed there lacks that validation."""
    every = trainer.val_check_interval
    if not trainer.limit_val_batches or not isinstance(every, int) or step == 0 or step % every:
        return False
    metrics = output_dir / "metrics.csv"
    rows = read_metrics(metrics) if metrics.is_file() else []
    return not any(r["step"] == step and math.isfinite(r["val_loss"]) for r in rows)


def metrics_csv(trainer: L.Trainer) -> MetricsCSV:
    """The trainer's MetricsCSV callback (build_trainer adds one)."""
    return next(c for c in trainer.callbacks if isinstance(c, MetricsCSV))


def write_results(
    trainer: L.Trainer, task: PretrainTask, output_dir: Path, license: str
) -> dict[str, Any]:
    """Check the run converged, then write upstream.pt, its model card and the upstream folder
    (rank zero); returns the final metrics and the paths (None on the other ranks)."""
    val_loss = trainer.callback_metrics.get("val_loss")
    result: dict[str, Any] = {
        "output_dir": str(output_dir),
        "steps": int(trainer.global_step),
        "train_loss": task.last_train_loss,
        "val_loss": None if val_loss is None else float(val_loss),
        "upstream": None,
        "model_card": None,
        "upstream_folder": None,
    }
    task.check_converged(result["val_loss"])
    if trainer.is_global_zero:
        result.update(write_run_upstream(trainer, task, output_dir, result["val_loss"], license))
    return result


# ----------------------------------------------------------------------------- helpers


def feature_config(datamodule: Any, data_config: dict[str, Any]) -> dict[str, Any]:
    """Feature settings to store in upstream.pt (what `features_from_waveforms` recomputes)."""
    fc = getattr(datamodule, "feature_config", None)
    if fc is not None:
        return dict(fc.to_dict() if hasattr(fc, "to_dict") else vars(fc))
    # FeatureConfig's own settings only: upstream.pt rebuilds a FeatureConfig from them (the
    # normalisation travels as the normaliser's mode)
    names = {f.name for f in fields(FeatureConfig)}
    return {k: v for k, v in data_config.items() if k in names}


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> Path | None:
    """`null` -> fresh run; `last` -> the newest checkpoint of <run dir>/checkpoints (highest
    step, whatever Lightning named it: `newest_checkpoint`), else a fresh run with a warning
    naming earlier runs that could be resumed; a path -> that file."""
    if ckpt_path in (None, "", "null"):
        return None
    if ckpt_path == "last":
        newest = newest_checkpoint(output_dir / "checkpoints")
        if newest is not None:
            if newest.name != "last.ckpt":
                log.info("ckpt_path=last: the newest checkpoint is %s", newest)
            return newest
        hint = ""
        candidates = sorted(
            output_dir.parent.glob("*/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime
        )
        if candidates:
            earlier = candidates[-1].parent.parent
            hint = (
                f"; to resume the latest earlier run add {override('hydra.run.dir', str(earlier))}"
            )
        warnings.warn(
            f"ckpt_path=last: no checkpoint in {output_dir / 'checkpoints'}, starting from "
            f"scratch{hint}",
            stacklevel=2,
        )
        return None
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise MissingFileError(f"ckpt_path={ckpt_path}: no such checkpoint file")
    return path


def resume_hint(output_dir: Path) -> str:
    """The command that resumes the run in `output_dir`: this process's own command line
    (its Hydra overrides, when run through Hydra) with the run directory and `ckpt_path=last`."""
    overrides: list[str] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        task = HydraConfig.get().overrides.task
        overrides = [o for o in task if not o.startswith("ckpt_path=")]
    except (ImportError, ValueError):  # run(cfg) called outside Hydra
        pass
    words = [*(shlex.quote(o) for o in overrides), override("hydra.run.dir", str(output_dir))]
    return " ".join(["python -m speechattn.pretrain", *words, "ckpt_path=last"])


def warn_if_requeued_from_scratch(resume: Path | None, output_dir: Path) -> None:
    """A requeued SLURM job reruns its command: without `ckpt_path=last` in a fixed run
    directory it starts over and the hours before the requeue are lost. Say so."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if resume is None and restarts not in ("", "0"):
        warnings.warn(
            f"this SLURM job was requeued (SLURM_RESTART_COUNT={restarts}) but training starts "
            f"from scratch in {output_dir}: submit it with hydra.run.dir=<a fixed directory, "
            f"e.g. outputs/pretrain/slurm-$SLURM_JOB_ID> ckpt_path=last (docs/preemption.md)",
            stacklevel=2,
        )


def check_resume_checkpoint(path: Path) -> dict[str, Any]:
    """Read `path` safely (`weights_only=True`) before Lightning does and return it. Raises
    `TorchFileError` naming it: when it is truncated, corrupt or refused (with the newest
    intact checkpoint beside it, as an override to paste), or when it is not a checkpoint of
    `python -m speechattn.pretrain` (a plain dict of weights, another program's file)."""
    try:
        checkpoint = load_torch_file(path, "cpu", "checkpoint to resume")
    except TorchFileError as e:
        steps = {p: checkpoint_step(p) for p in path.parent.glob("*.ckpt") if p != path}
        intact = [p for p, step in steps.items() if step is not None]
        if intact:
            newest = max(intact, key=lambda p: (steps[p], p.name))
            hint = (
                f"resume from the newest intact checkpoint instead (step {steps[newest]}): "
                f"{override('ckpt_path', str(newest))}"
            )
        else:
            hint = f"no intact checkpoint in {path.parent}: start afresh without ckpt_path"
        raise TorchFileError(f"{e}; {hint}") from e
    expected = ("global_step", "state_dict", "hyper_parameters", "optimizer_states")
    missing = [k for k in expected if not isinstance(checkpoint, dict) or k not in checkpoint]
    if missing or "model" not in (checkpoint.get("hyper_parameters") or {}):
        if isinstance(checkpoint, dict) and all(torch.is_tensor(v) for v in checkpoint.values()):
            kind = f"a plain dict of {len(checkpoint)} tensors"  # a bare state_dict
        else:
            kind = f"a {type(checkpoint).__name__}"
        found = sorted(map(str, checkpoint))[:4] if isinstance(checkpoint, dict) else []
        raise TorchFileError(
            f"ckpt_path={path}: not a checkpoint of `python -m speechattn.pretrain` ({kind}, "
            f"keys {found}, lacking {missing or ['hyper_parameters.model']}): resume from a "
            f"run's checkpoints/*.ckpt, or start afresh without ckpt_path"
        )
    return checkpoint


def resolve_precision(precision: Any, accelerator: str) -> Any:
    """`auto`: bf16-mixed on GPUs that support it, 32-true otherwise. Mixed precision on CPU is
    replaced by fp32 (slower there, and the defaults promise fp32 on CPU)."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if precision == "auto":
        return "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"
    if not on_gpu and str(precision) in ("bf16-mixed", "16-mixed", "16", "bf16"):
        log.warning("precision=%s on CPU: using 32-true instead", precision)
        return "32-true"
    return precision

"""`run(cfg)`: pretrain AALBERT as configured and write the run directory (build the data,
task, callbacks, loggers and trainer, fit, write the results); `python -m speechattn.pretrain`
is its Hydra wrapper. Resuming: `resume.py`; stopping on a signal: `tasks/preemption.py`.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from speechattn.attention import autotune
from speechattn.data import DataConfig, build_datamodule
from speechattn.data.features import FeatureConfig
from speechattn.errors import is_int, is_number, require
from speechattn.model.aalbert import ModelConfig
from speechattn.model.masking import MaskingConfig
from speechattn.model.optim import OptimConfig
from speechattn.tasks.common import (
    DataWait,
    MetricsCSV,
    configured_loggers,
    finish_loggers,
    progress_bar,
    quiet_library_notices,
)
from speechattn.tasks.preemption import AtomicCheckpointIO, StopOnSignal, remove_partial_checkpoints
from speechattn.tasks.pretrain.data import ResumableData
from speechattn.tasks.pretrain.model_card import write_run_upstream
from speechattn.tasks.pretrain.module import PretrainTask
from speechattn.tasks.pretrain.resume import (
    Resume,
    RunLock,
    earlier_result_noted,
    init_from_upstream,
    periodic_checkpoints,
    resume_from,
    resume_hint,
)
from speechattn.utils import atomic_write_text, plain

log = logging.getLogger("speechattn.pretrain")


def run(cfg: DictConfig, datamodule: Any = None) -> dict[str, Any]:
    """Pretrain as configured; returns final metrics and paths. `datamodule` (of the batch
    contract, docs/ARCHITECTURE.md) replaces the data layer's, e.g. tests' synthetic data."""
    quiet_library_notices()
    check_settings(cfg)
    output_dir = Path(cfg.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    # under DDP every rank runs this; rank 0 (known from the environment already) holds the lock
    with RunLock(output_dir, hold=rank_zero_only.rank == 0) as lock:
        resume = resume_from(cfg, output_dir)  # None: a fresh run; refusals before any data
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        inner = datamodule if datamodule is not None else build_datamodule(cfg.data, "pretrain")
        task = build_task(cfg, inner, resume)
        data = ResumableData(inner, seed=cfg.seed, batch_masker=task.batch_masker)
        requeue = bool((cfg.get("preemption") or {}).get("requeue", True))  # PreemptionConfig
        stop = StopOnSignal(output_dir / "checkpoints", requeue=requeue)
        metrics = MetricsCSV(output_dir / "metrics.csv", cfg.trainer.log_every_n_steps)
        checkpoints = periodic_checkpoints(
            output_dir / "checkpoints", int(cfg.checkpoint.every_n_steps), int(cfg.checkpoint.keep)
        )
        callbacks = [lock, checkpoints, metrics, DataWait(), stop]  # the lock's check first
        loggers = configured_loggers(cfg)
        trainer = build_trainer(cfg, output_dir, callbacks, loggers)
        hint = resume_hint(output_dir)
        open_run_dir(cfg, output_dir, resume, hint)
        try:
            with earlier_result_noted(output_dir, resume):
                with stop.handling_signals(trainer, hint):
                    fit(cfg, trainer, task, data, resume, stop, metrics)
                lock.check()  # upstream.pt and its card: this run's folder still
                return write_results(trainer, task, output_dir, str(cfg.get("license") or "mit"))
        finally:
            finish_loggers(loggers)


def check_settings(cfg: DictConfig) -> None:
    """`ConfigError` for a setting that would make the run do nothing or fail later, before
    any data is read (the groups' own settings by building their dataclasses)."""
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
    data = cfg.get("data")
    if data is not None and "_target_" not in data:  # tests and custom corpora bring their own
        DataConfig(**plain(data))
    ModelConfig(**plain(cfg.model.net))
    MaskingConfig(**plain(cfg.model.masking))
    OptimConfig(**plain(cfg.model.optimizer))
    for name, value, least, rule in (
        ("checkpoint.every_n_steps", cfg.checkpoint.every_n_steps, 1, "an integer >= 1"),
        ("checkpoint.keep", cfg.checkpoint.keep, -1, "an integer >= 0, or -1 (all)"),
        ("max_nonfinite", cfg.max_nonfinite, 1, "an integer >= 1"),
    ):
        require(is_int(value) and value >= least, name, value, rule)
    bar = cfg.get("progress_bar", "rich")
    require(bar in ("rich", "tqdm", "none", None), "progress_bar", bar, "rich, tqdm or none")


def build_task(cfg: DictConfig, datamodule: Any, resume: Resume | None) -> PretrainTask:
    """The task of `cfg` for `datamodule`'s data: checked against the checkpoint it resumes,
    or holding `cfg.init_from`'s weights, and told what upstream.pt records of the data."""
    cfg.model.net.feature_dim = int(datamodule.feature_dim)
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
    if resume is not None:
        resume.check_fits(task)
    # AttentionGroupConfig's default where a config was built without the schema
    autotune.enable(task.model, bool(cfg.attention.get("autotune", True)))
    data_config = plain(cfg.get("data")) or {}
    if "max_frames" in data_config:  # the data layer crops to it; fail now, not at a long batch
        task.model.check_input_frames(data_config["max_frames"], "data.max_frames")
    # the feature settings upstream.pt stores: the data module's, else the data config's
    # FeatureConfig fields (the normalisation travels as the normaliser's mode)
    fc = getattr(datamodule, "feature_config", None)
    if fc is not None:
        features = dict(fc.to_dict() if hasattr(fc, "to_dict") else vars(fc))
    else:
        names = {f.name for f in fields(FeatureConfig)}
        features = {k: v for k, v in data_config.items() if k in names}
    init_from = cfg.get("init_from") or None
    if init_from is not None and resume is None:
        normalization = data_config.get("normalization")  # None: a datamodule of the caller's
        parent = init_from_upstream(task.model, init_from, features, normalization)
        task.data_info["init_from"] = parent
        log.info("starting from the weights of %s (sha256 %s)", parent["path"], parent["sha256"])
    task.data_info.update(
        feature_config=features,
        corpus=str(data_config.get("corpus", type(datamodule).__name__)),
        data_config=data_config,
        model_name=str(cfg.model.get("name", "")),
    )
    return task


def build_trainer(
    cfg: DictConfig, output_dir: Path, callbacks: list[L.Callback], loggers: list[Any]
) -> L.Trainer:
    """`cfg.trainer` with `callbacks`, the progress bar, `loggers` and atomic checkpoint writes."""
    bar = cfg.get("progress_bar", "rich")
    # a bar refresh reads train_loss from the device: once per log interval off the CPU
    refresh = 1 if cfg.trainer.accelerator == "cpu" else int(cfg.trainer.log_every_n_steps)
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


@rank_zero_only
def open_run_dir(cfg: DictConfig, output_dir: Path, resume: Resume | None, hint: str) -> None:
    """Before the first validation or step (rank zero): config.yaml, no partial checkpoint
    files, a fresh metrics.csv for a fresh run; log how the run resumes (`hint`) or from where."""
    atomic_write_text(output_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    log.info("run directory: %s", output_dir)
    remove_partial_checkpoints(output_dir / "checkpoints")
    if resume is None:
        log.info("resume after a crash with: %s", hint)
        (output_dir / "metrics.csv").unlink(missing_ok=True)
    else:
        log.info("resuming from %s", resume.path)


def fit(
    cfg: DictConfig,
    trainer: L.Trainer,
    task: PretrainTask,
    data: ResumableData,
    resume: Resume | None,
    stop: StopOnSignal,
    metrics: MetricsCSV,
) -> None:
    """`trainer.fit` from `resume` (None: from scratch), with the validations outside it that
    make metrics.csv read as one uninterrupted run (a stop signal between them stops too)."""
    every = trainer.val_check_interval
    every = every if trainer.limit_val_batches and isinstance(every, int) else 0  # in steps
    ckpt_path, step = (str(resume.path), resume.step) if resume is not None else (None, 0)
    if resume is None and cfg.get("validate_at_start", True) and trainer.limit_val_batches:
        trainer.validate(task, datamodule=data, verbose=False)
        stop.check()
    elif step and every and step % every == 0 and not metrics.has_validation(step):
        # stopped between this step's checkpoint and the end of its validation, which fit
        # skips on resume: run it here, on the checkpoint's weights
        log.info("repeating the validation at step %d that the stop cut short", step)
        metrics.step_override = step
        try:
            trainer.validate(
                task, datamodule=data, ckpt_path=ckpt_path, verbose=False, weights_only=True
            )
        finally:
            metrics.step_override = None
        stop.check()
    trainer.fit(task, datamodule=data, ckpt_path=ckpt_path, weights_only=True)
    if every and trainer.global_step % every:  # val_loss of the final weights
        trainer.validate(task, datamodule=data, verbose=False)


def write_results(
    trainer: L.Trainer, task: PretrainTask, output_dir: Path, license: str
) -> dict[str, Any]:
    """Check the run converged, then write upstream.pt, its card and the upstream folder (rank
    zero); returns the final metrics and the paths (None on the other ranks)."""
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

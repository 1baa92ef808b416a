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
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from speechattn.attention import autotune
from speechattn.data import build_datamodule
from speechattn.errors import MissingFileError
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
    remove_partial_checkpoints,
)
from speechattn.tasks.pretrain.data import ResumableData
from speechattn.tasks.pretrain.model_card import (
    median_metric,
    training_device,
    write_model_card,
)
from speechattn.tasks.pretrain.module import NonFiniteLossError, PretrainTask
from speechattn.utils import plain

log = logging.getLogger("speechattn.pretrain")


def run(cfg: DictConfig, datamodule: Any = None) -> dict[str, Any]:
    """Pretrain as configured; returns final metrics and paths.

    `datamodule` replaces the data layer's PretrainDataModule (tests pass synthetic data);
    it must follow the batch contract of docs/ARCHITECTURE.md.
    """
    quiet_library_notices()
    output_dir = Path(cfg.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    resume = resolve_ckpt_path(cfg.get("ckpt_path"), output_dir)
    resume_step = check_resume_checkpoint(resume) if resume is not None else 0
    warn_if_requeued_from_scratch(resume, output_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    # data
    inner = datamodule if datamodule is not None else build_datamodule(cfg.data, "pretrain")
    data = ResumableData(inner, seed=cfg.seed)
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
    # two-kernel variants time both kernels per length bucket (config.AttentionGroupConfig;
    # its default where a config was built without the schema)
    autotune.enable(task.model, bool(cfg.attention.get("autotune", True)))
    data_config = plain(cfg.get("data")) or {}
    if "max_frames" in data_config:  # the data layer crops to it; fail now, not at a long batch
        task.model.check_input_frames(data_config["max_frames"], "data.max_frames")
    task.set_data_info(
        feature_config=feature_config(inner, data_config),
        corpus=str(data_config.get("corpus", type(inner).__name__)),
        data_config=data_config,
        model_name=str(cfg.model.get("name", "")),
    )
    # trainer
    preemption = cfg.get("preemption") or {}  # config.PreemptionConfig
    stop = StopOnSignal(output_dir / "checkpoints", requeue=bool(preemption.get("requeue", True)))
    trainer = build_trainer(cfg, output_dir, stop)
    # Under DDP the launched processes run this function too; rank_zero_only.rank is read from
    # the launcher's environment, so it is right before the processes are connected.
    hint = resume_hint(output_dir)
    if rank_zero_only.rank == 0:
        OmegaConf.save(cfg, output_dir / "config.yaml", resolve=True)
        log.info("run directory: %s", output_dir)
        remove_partial_checkpoints(output_dir / "checkpoints")
        if resume is None:
            log.info("resume after a crash with: %s", hint)
            (output_dir / "metrics.csv").unlink(missing_ok=True)  # a fresh run, a fresh file
        else:
            log.info("resuming from %s", resume)

    # fit; SIGTERM/SIGUSR1 end it after the step in progress, with checkpoints/last.ckpt
    ckpt_path = str(resume) if resume else None
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
            # the curve in metrics.csv and upstream.pt's val_loss must describe the final weights
            trainer.validate(task, datamodule=data, verbose=False)

    # results
    try:
        return write_results(trainer, task, output_dir, license=str(cfg.get("license") or "mit"))
    finally:
        finish_loggers(trainer.loggers)


def build_trainer(cfg: DictConfig, output_dir: Path, *extra_callbacks: L.Callback) -> L.Trainer:
    """`cfg.trainer` instantiated with the run's checkpoints (written atomically), metrics.csv,
    bar, loggers and `extra_callbacks`."""
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
    )
    bar = cfg.get("progress_bar", "rich")
    # a bar refresh reads train_loss from the device: once per log interval off the CPU
    refresh = 1 if cfg.trainer.accelerator == "cpu" else int(cfg.trainer.log_every_n_steps)
    metrics = MetricsCSV(output_dir / "metrics.csv", cfg.trainer.log_every_n_steps)
    callbacks = [periodic, metrics, DataWait(), *extra_callbacks]
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
    """Check the run converged, then write upstream.pt and its model card (rank zero)."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    result: dict[str, Any] = {
        "output_dir": str(output_dir),
        "steps": int(trainer.global_step),
        "train_loss": task.last_train_loss,
        "val_loss": metrics.get("val_loss"),
        "upstream": None,
        "model_card": None,
    }
    task.check_converged()
    val_loss = result["val_loss"]
    if val_loss is not None and not math.isfinite(val_loss):
        raise NonFiniteLossError(
            f"the final validation loss is {val_loss} at step {result['steps']}: the model "
            f"diverged or the validation features hold NaN/inf; no upstream.pt is written. "
            f"{task.divergence_advice()}"
        )
    if trainer.is_global_zero:
        metrics_csv = output_dir / "metrics.csv"
        rows = read_metrics(metrics_csv) if metrics_csv.is_file() else []
        run_facts = {
            "val_loss": result["val_loss"],
            "frames_per_s": median_metric(rows, "frames_per_s"),
            "data_wait": median_metric(rows, "data_wait"),
            "precision": str(trainer.precision),
            "device": training_device(trainer),
        }
        upstream = task.export_upstream(output_dir / "upstream.pt", run_facts)
        card = write_model_card(upstream, rows, license=license)
        result.update(upstream=str(upstream), model_card=str(card))
        print(f"upstream.pt written to {upstream} (model card: {card})", flush=True)
    return result


# ----------------------------------------------------------------------------- helpers


def feature_config(datamodule: Any, data_config: dict[str, Any]) -> dict[str, Any]:
    """Feature settings to store in upstream.pt (what `features_from_waveforms` recomputes)."""
    fc = getattr(datamodule, "feature_config", None)
    if fc is not None:
        return dict(fc.to_dict() if hasattr(fc, "to_dict") else vars(fc))
    keys = ("n_mels", "deltas", "normalization")
    return {k: data_config[k] for k in keys if k in data_config}


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> Path | None:
    """`null` -> fresh run; `last` -> <run dir>/checkpoints/last.ckpt if it exists (else a fresh
    run, with a warning naming earlier runs that could be resumed); a path -> that file."""
    if ckpt_path in (None, "", "null"):
        return None
    if ckpt_path == "last":
        last = output_dir / "checkpoints" / "last.ckpt"
        if last.is_file():
            return last
        hint = ""
        candidates = sorted(
            output_dir.parent.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime
        )
        if candidates:
            hint = f"; to resume the latest earlier run add hydra.run.dir={candidates[-1].parent.parent}"
        warnings.warn(
            f"ckpt_path=last: no checkpoint in {last.parent}, starting from scratch{hint}",
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
    args = [*overrides, f"hydra.run.dir={output_dir}", "ckpt_path=last"]
    return " ".join(["python -m speechattn.pretrain", *(shlex.quote(a) for a in args)])


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


def check_resume_checkpoint(path: Path) -> int:
    """Read `path` safely (`weights_only=True`) before Lightning does and return its step; when
    it is truncated, corrupt or refused, raise `TorchFileError` naming it and the newest
    periodic checkpoint beside it that reads."""
    try:
        return int(load_torch_file(path, "cpu", "checkpoint to resume").get("global_step", 0))
    except TorchFileError as e:
        for periodic in sorted(path.parent.glob("step=*.ckpt"), reverse=True):  # newest first
            if periodic == path:
                continue
            try:
                load_torch_file(periodic, "cpu")
            except TorchFileError:
                continue
            hint = f"resume from the newest intact checkpoint instead: ckpt_path={periodic}"
            break
        else:
            hint = f"no intact periodic checkpoint in {path.parent}: start afresh without ckpt_path"
        raise TorchFileError(f"{e}; {hint}") from e


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

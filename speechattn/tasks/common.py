"""Callbacks and small helpers shared by the training entry points."""

from __future__ import annotations

import csv
import io
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar, TQDMProgressBar
from torch import Tensor

from speechattn.errors import ConfigError
from speechattn.utils import append_text, atomic_write_text, link_error


def host_value(value: float) -> Tensor:
    """A number for `LightningModule.log` as () float32 on the CPU: a logged Python float
    would become a tensor on the module's device (a blocking copy every step), read back by
    the progress bar and loggers."""
    return torch.tensor(float(value), dtype=torch.float32)


class MetricsCSV(Callback):
    """`metrics.csv` with fixed columns, one row per logged step and one per validation.
    Unlike Lightning's CSVLogger it survives a resume: rows after the checkpoint's step are
    dropped (they are recomputed), so the file reads as one uninterrupted run."""

    COLUMNS = ("step", "train_loss", "val_loss", "lr", "frames_per_s", "data_wait", "elapsed_s")

    def __init__(self, path: str | Path, every_n_steps: int = 10) -> None:
        self.path = Path(path)
        self.every_n_steps = max(1, int(every_n_steps))
        self._start = time.perf_counter()
        self._elapsed_before = 0.0
        # the step of a validation outside `fit` that is not the trainer's (pretrain run.py)
        self.step_override: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        step = trainer.global_step
        rows = []
        if self.path.is_symlink():  # a link planted in the run folder: never read or written
            raise link_error(self.path)
        if self.path.is_file():  # keep the history up to this point (resume, or step-0 validation)
            with self.path.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if r.get("step") and int(r["step"]) <= step]
            if rows and rows[-1].get("elapsed_s"):
                self._elapsed_before = float(rows[-1]["elapsed_s"])
        atomic_write_text(self.path, self._csv(rows, header=True))  # replaces, never follows
        self._start = time.perf_counter()

    def _csv(self, rows: list[dict[str, Any]], header: bool = False) -> str:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.COLUMNS, extrasaction="ignore")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return text.getvalue()

    def _write(self, trainer: L.Trainer, keys: tuple[str, ...]) -> None:
        metrics = trainer.callback_metrics
        step = trainer.global_step if self.step_override is None else self.step_override
        row: dict[str, Any] = {"step": step}
        row.update({key: f"{float(metrics[key]):.6g}" for key in keys if key in metrics})
        row["elapsed_s"] = f"{self._elapsed_before + time.perf_counter() - self._start:.2f}"
        append_text(self.path, self._csv([row]))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step == 0 or trainer.fit_loop._should_accumulate():
            return
        if step % self.every_n_steps == 0 or step == trainer.max_steps:
            self._write(trainer, ("train_loss", "lr", "frames_per_s", "data_wait"))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        if self.path.is_symlink():
            raise link_error(self.path)
        if not self.path.is_file():  # validation before training: start the file
            atomic_write_text(self.path, self._csv([], header=True))
        self._write(trainer, ("val_loss",))

    def has_validation(self, step: int) -> bool:
        """Whether the file holds the validation of `step` (a finite `val_loss` row)."""
        rows = read_metrics(self.path)
        return any(r["step"] == step and math.isfinite(r["val_loss"]) for r in rows)


class DataWait(Callback):
    """Logs `data_wait`: the share of each training batch's wall time (from the previous
    batch's end to its own) spent waiting for the loader and the copy to the device; near 1
    the model waits for data. Batches after a validation or a checkpoint are not measured."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # seconds (tests give a clock they advance themselves)
        self._end: float | None = None  # previous batch's end
        self._wait: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        self._wait = None if self._end is None else self.clock() - self._end

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        now = self.clock()
        if self._wait is not None and self._end is not None and now > self._end:
            share = self._wait / (now - self._end)
            pl_module.log("data_wait", host_value(share), on_step=True, batch_size=1)
        self._end = now

    def _pause(self, *args) -> None:
        self._end = None

    on_validation_start = on_save_checkpoint = on_train_start = _pause


class StepRichProgressBar(RichProgressBar):
    """Rich bar for runs bounded by `max_steps`: says "Pretraining", not "Epoch 0/-2"."""

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{'Pretraining':{len(self.validation_description)}}"


def progress_bar(kind: str, refresh_rate: int = 1) -> list[ProgressBar]:
    """`rich` (default), `tqdm`, or `none`, as a callback list to splice in. A refresh reads
    the logged device tensors (a sync on a GPU): GPU runs refresh every log interval."""
    if kind == "rich":
        return [StepRichProgressBar(refresh_rate=refresh_rate, leave=True)]
    if kind == "tqdm":
        return [TQDMProgressBar(refresh_rate=refresh_rate)]
    if kind in ("none", None):
        return []
    raise ConfigError(f"unknown progress_bar {kind!r}; choose rich, tqdm or none")


def quiet_library_notices() -> None:
    """Silence deprecation notices raised inside Lightning that users cannot act on."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a `metrics.csv` as floats (NaN for empty cells); [] when there is no such file."""
    if not Path(path).is_file():
        return []
    with Path(path).open(newline="") as f:
        return [
            {k: float(v) if v not in ("", None) else math.nan for k, v in r.items()}
            for r in csv.DictReader(f)
        ]


def configured_loggers(cfg: Any) -> list[Any]:
    """The loggers of `cfg.logger` (conf/logger/: name -> `_target_`), instantiated; [] for
    `logger=none`. Their paths interpolate `${output_dir}`, so set it first."""
    from hydra.utils import instantiate

    configs = [c for c in (cfg.get("logger") or {}).values() if c]
    for c in configs:
        uri = str(c.get("tracking_uri") or "")
        if str(c.get("_target_", "")).endswith("MLFlowLogger") and uri.startswith("file:"):
            # MLflow >= 3.7 refuses its file store (conf/logger/mlflow.yaml's) unless asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return [instantiate(c) for c in configs]


def finish_loggers(loggers: Any) -> None:
    """End wandb's run, open after `fit` (the next job of a multirun would log into it)."""
    for logger in loggers:
        if type(logger).__name__ == "WandbLogger" and logger._experiment is not None:
            logger.experiment.finish()


def run_output_dir(cfg: Any) -> Path:
    """Where a run writes: `cfg.output_dir` when set (tests, scripts), else Hydra's run dir,
    else the current directory (a plain `run(cfg)` call outside Hydra)."""
    if cfg.get("output_dir"):
        return Path(cfg.output_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        return Path.cwd()

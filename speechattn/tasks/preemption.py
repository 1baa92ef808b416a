"""Preemption: SIGTERM, SIGUSR1 and SIGUSR2 end training at a step boundary with a resumable
checkpoint, in place of Lightning's own handling (why: docs/preemption.md). The handler only
records the signal; after each optimizer step the ranks agree whether any got one, and if so
all write `last.ckpt` and stop at that step with `TrainingStopped`.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from speechattn.data.claims import WorkerDied
from speechattn.utils import TEMP_MARK, atomic_path

log = logging.getLogger("speechattn.preemption")

# time-limit warnings that ask for a requeue: `sbatch --signal=USR1@90`, and USR2, what
# hydra-submitit-launcher's jobs ask for (submitit's handler would requeue without saving)
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGTERM, *REQUEUE_SIGNALS)


class TrainingStopped(SystemExit):
    """Training was stopped by `signum` after writing a resumable checkpoint: a `SystemExit`
    with code 128 + signal number (as a shell reports it), so no traceback."""

    def __init__(self, signum: signal.Signals, step: int, message: str) -> None:
        super().__init__(128 + int(signum))
        self.signum = signum
        self.step = step
        self.message = message

    def __str__(self) -> str:
        return self.message


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` writing through a temporary file beside the target, fsynced and
    renamed onto it: a resume sees the previous checkpoint or the new one, never a truncated one."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())  # the rename must never expose unwritten blocks


def remove_partial_checkpoints(checkpoint_dir: Path) -> None:
    """Delete the temporary files killed checkpoint writes left in `checkpoint_dir`."""
    for partial in sorted(checkpoint_dir.glob(f"*.ckpt{TEMP_MARK}*")):
        log.info("removing %s, left by a checkpoint write that was killed", partial)
        partial.unlink(missing_ok=True)


class StopOnSignal(Callback):
    """SIGTERM, SIGUSR1 or SIGUSR2 during training: finish the step (and a validation in
    progress), write `last.ckpt`, stop; one after the last step is ignored. Use as
    `with stop.handling_signals(trainer, resume_hint): trainer.fit(...)` with this callback
    among the trainer's."""

    def __init__(self, checkpoint_dir: str | Path, requeue: bool = True) -> None:
        self.last_path = Path(checkpoint_dir) / "last.ckpt"
        self.requeue = requeue
        self.received: signal.Signals | None = None  # the first stop signal this process got
        self.saved: Path | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            log.info("received %s: stopping after the current step", self.received.name)

    def _take_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._on_signal)

    def check(self) -> None:
        """Outside `fit`'s steps (before it, between validations): stop now if a signal came."""
        if self.received is not None:
            raise SIGTERMException

    @contextmanager
    def handling_signals(self, trainer: L.Trainer, resume_hint: str) -> Iterator[None]:
        """Stop signals set the stop; `SIGTERMException` from the block becomes `TrainingStopped`
        with the log line saying where the run stopped and how to resume it, as does the end
        of a feature extraction whose workers the same signal stopped (`WorkerDied`)."""
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self._take_signals()
        try:
            self.check()
            yield
        except SIGTERMException:
            raise self._stopped(trainer, resume_hint) from None
        except WorkerDied:  # a signal to the process group also ends the extraction's workers
            if self.received is None:
                raise
            raise self._stopped(trainer, resume_hint) from None
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_signals()  # fit (or validate) has just installed the connector's handlers

    on_validation_start = on_train_start

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.fit_loop._should_accumulate():
            return  # mid-accumulation: not a step boundary
        # every rank, every step: one tiny all-reduce under DDP, a flag read in one process
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        trainer.save_checkpoint(self.last_path)  # all ranks: its barrier meets; rank 0 writes
        self.saved = self.last_path
        # raised here the state is a periodic checkpoint's; skipped: the module's
        # on_train_batch_end (PretrainTask has none), this step's values to the loggers
        raise SIGTERMException

    def _stopped(self, trainer: L.Trainer, resume_hint: str) -> TrainingStopped:
        """Log the stop and requeue under SLURM (rank 0); the exception that ends the process."""
        signum = self.received or signal.SIGTERM  # a DDP rank may stop on rank 0's signal only
        step = int(trainer.global_step)
        where = f"checkpoint {self.saved}" if self.saved else "no checkpoint written in this run"
        message = f"stopped by {signum.name} at step {step} ({where})"
        job = slurm_job_id()
        if not trainer.is_global_zero:  # rank 0 requeues and tells
            return TrainingStopped(signum, step, message)
        if signum in REQUEUE_SIGNALS and self.requeue and job is not None:
            if requeue_slurm_job(job):
                message += f"; SLURM job {job} requeued: it resumes if started with {resume_hint}"
            else:
                message += f"; requeueing SLURM job {job} failed: resume with {resume_hint}"
        else:
            message += f"; resume with: {resume_hint}"
        log.warning("%s", message)
        return TrainingStopped(signum, step, message)


def slurm_job_id() -> str | None:
    """This job's id for `scontrol` (`<array job>_<task>` in an array), or None outside SLURM."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job(job: str) -> bool:
    """`scontrol requeue <job>`: SLURM ends this job and queues it again (it needs the job
    submitted with `--requeue`, or the cluster's JobRequeue=1). True when scontrol succeeded."""
    if not re.fullmatch(r"\d+(_\d+)?", job):
        log.error("not requeueing: %r is not a SLURM job id", job)
        return False
    cmd = ["scontrol", "requeue", job]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("%s failed: %s", " ".join(cmd), e)
        return False
    if done.returncode != 0:
        log.error("%s exited with %d: %s", " ".join(cmd), done.returncode, done.stderr.strip())
        return False
    log.info("requeued SLURM job %s", job)
    return True

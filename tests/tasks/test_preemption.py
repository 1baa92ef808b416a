"""SIGTERM / SIGUSR1 / SIGKILL during pretraining, and SLURM requeue (speechattn.tasks.preemption).

Every interrupted run is resumed with `ckpt_path=last` and must end exactly where an
uninterrupted run of the same config ends: the same weights and the same metrics.csv (steps,
train and validation losses). All runs, in this process or in subprocesses, use one thread,
so their floating-point results are bit-identical.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _pretrain_testing import compose_pretrain

from speechattn.pretrain import run
from speechattn.tasks.preemption import (
    StopOnSignal,
    TrainingStopped,
    requeue_slurm_job,
    slurm_job_id,
)
from speechattn.tasks.pretrain.resume import warn_if_requeued_from_scratch
from speechattn.utils import TEMP_MARK

HERE = Path(__file__).resolve().parent
RUN_MODULE = sys.modules["speechattn.tasks.pretrain.run"]  # the package's `run` is a function
RUN = [
    "~data",
    "+data._target_=_pretrain_testing.SyntheticPretrainData",
    "+data.n_val=32",  # 4 validation batches: a signal can land inside a validation
    "model.net.dim=32",
    "model.net.num_layers=2",
    "model.net.num_heads=2",
    "model.net.ffn_dim=64",
    "model.optimizer.lr=1e-2",
    "trainer.max_steps=120",
    "trainer.val_check_interval=40",
    "trainer.log_every_n_steps=10",
    "trainer.enable_model_summary=false",
    "checkpoint.every_n_steps=20",
    "progress_bar=none",
    "logger=none",
]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Runs in this process use one thread, like the subprocesses (OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    run(compose_pretrain(out, *RUN, shrink=False))
    return out


def run_in_process(out: Path, *overrides: str) -> dict[str, Any]:
    return run(compose_pretrain(out, *RUN, *overrides, shrink=False))


def assert_same_run(got: Path, reference: Path) -> None:
    """Same final weights (exactly) and the same metrics.csv curve as `reference`."""
    ref = torch.load(reference / "upstream.pt", weights_only=True)
    new = torch.load(got / "upstream.pt", weights_only=True)
    assert new["metadata"]["steps"] == ref["metadata"]["steps"] == 120
    for name, value in ref["state_dict"].items():
        assert torch.equal(new["state_dict"][name], value), name

    def curve(run_dir: Path) -> list[tuple[str, str, str]]:
        with (run_dir / "metrics.csv").open(newline="") as f:
            return [(r["step"], r["train_loss"], r["val_loss"]) for r in csv.DictReader(f)]

    assert curve(got) == curve(reference)


def checkpoint_step(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["global_step"])


def val_steps(run_dir: Path) -> list[int]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r["val_loss"]]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A subprocess's environment: the test helpers importable, one thread, `extra` on top."""
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(extra or {})}


def cli(
    args: list[str],
    run_dir: Path,
    env: dict[str, str] | None = None,
    code: str | None = None,
    own_group: bool = False,
) -> subprocess.Popen:
    """`python -m speechattn.pretrain ARGS hydra.run.dir=RUN_DIR` (or `python -c CODE ...`);
    `own_group`: in a process group of its own, for a signal to all its processes."""
    program = ["-c", code] if code else ["-m", "speechattn.pretrain"]
    return subprocess.Popen(
        [sys.executable, *program, *args, f"hydra.run.dir={run_dir}"],
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=own_group,
    )


def signal_after(proc: subprocess.Popen, path: Path, signum: int) -> tuple[int, str]:
    """Send `signum` to `proc` a little after `path` appears (mid-run); its status and output."""
    deadline = time.time() + 180
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # some steps past the checkpoint
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out


STOPPED = re.compile(r"stopped by (SIG\w+) at step (\d+) \(checkpoint (\S+)\); (.*)$", re.M)


def interrupting_save(signum: int, nth: int) -> Callable[..., None]:
    """A `torch.save` that sends `signum` to this process in the middle of the `nth` write of
    `last.ckpt` (half the bytes written, then the signal, then the rest after 0.2 s)."""
    real_save = torch.save
    seen = 0

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal seen
        if not Path(getattr(f, "name", str(f))).name.startswith(f"last.ckpt{TEMP_MARK}"):
            return real_save(obj, f, *args, **kwargs)
        seen += 1
        if seen != nth:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.kill(os.getpid(), signum)
        time.sleep(0.2)  # a handled signal runs its handler here
        f.write(data[len(data) // 2 :])

    return save


class SignalAt(L.Callback):
    """Sends `signum` to this process from callback hook `hook` when the trainer is at `step`."""

    def __init__(self, hook: str, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum, self.sent = step, signum, False

        def fire(trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
            if not self.sent and trainer.global_step == self.step:
                self.sent = True
                os.kill(os.getpid(), self.signum)

        setattr(self, hook, fire)


def with_callback(monkeypatch, callback: L.Callback) -> None:
    """`callback` after the run's own callbacks (before the progress bar)."""
    build_trainer = RUN_MODULE.build_trainer

    def with_it(cfg, output_dir, callbacks, loggers) -> L.Trainer:
        return build_trainer(cfg, output_dir, [*callbacks, callback], loggers)

    monkeypatch.setattr(RUN_MODULE, "build_trainer", with_it)


# ----------------------------------------------------------------------------- signals


@pytest.mark.slow
def test_sigterm_mid_run_stops_after_the_step_and_the_logged_command_resumes(tmp_path, reference):
    run_dir = tmp_path / "run"
    status, out = signal_after(
        cli(RUN, run_dir), run_dir / "checkpoints" / "step=0000020.ckpt", signal.SIGTERM
    )
    assert status == 128 + signal.SIGTERM, out[-3000:]
    (name, step, checkpoint, rest) = STOPPED.search(out).groups()
    assert name == "SIGTERM" and 20 <= int(step) < 120, out[-3000:]
    assert checkpoint == str(run_dir / "checkpoints" / "last.ckpt")
    assert checkpoint_step(Path(checkpoint)) == int(step)  # the stop's step, saved
    assert not (run_dir / "upstream.pt").exists()

    # what the log line says to run, run as it stands
    assert rest.startswith("resume with: python -m speechattn.pretrain ")
    command = shlex.split(rest.removeprefix("resume with: "))
    assert command[-2:] == [f"hydra.run.dir={run_dir}", "ckpt_path=last"]
    resumed = subprocess.run(
        [sys.executable, *command[1:]],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in resumed.stdout
    assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_sigusr1_under_slurm_saves_requeues_and_the_requeued_job_resumes(tmp_path, reference):
    """The documented sbatch line: a run directory from SLURM_JOB_ID and ckpt_path=last, so the
    requeued job (the same command, SLURM_RESTART_COUNT=1) picks up last.ckpt by itself."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    slurm = {  # enough for Lightning to choose its SLURMEnvironment (auto_requeue=True)
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "pretrain",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    run_dir = tmp_path / "slurm-4242"
    args = [*RUN, "ckpt_path=last"]
    status, out = signal_after(
        cli(args, run_dir, slurm), run_dir / "checkpoints" / "step=0000020.ckpt", signal.SIGUSR1
    )
    assert status == 128 + signal.SIGUSR1, out[-3000:]
    name, step, _, rest = STOPPED.search(out).groups()
    assert name == "SIGUSR1" and 20 <= int(step) < 120
    assert rest.startswith("SLURM job 4242 requeued")
    assert calls.read_text() == "requeue 4242\n"
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == int(step)
    assert not list(run_dir.glob("hpc_ckpt_*")), "Lightning's own SIGUSR1 handler ran"

    requeued = cli(args, run_dir, {**slurm, "SLURM_RESTART_COUNT": "1"})
    out, _ = requeued.communicate(timeout=240)
    assert requeued.returncode == 0, out[-3000:]
    assert "resuming from" in out and "requeued (SLURM_RESTART_COUNT" not in out
    assert calls.read_text() == "requeue 4242\n"  # finished: not requeued again
    assert_same_run(run_dir, reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hook", "at", "stops_at"),
    [
        ("on_train_batch_start", 39, 40),  # stops before step 40's validation: resume repeats it
        ("on_validation_batch_start", 40, 41),  # inside step 40's validation: it finishes first
    ],
)
def test_sigterm_at_a_validation_step_keeps_the_validation_curve(
    tmp_path, reference, monkeypatch, hook, at, stops_at
):
    with_callback(monkeypatch, SignalAt(hook, at))
    with pytest.raises(TrainingStopped) as stopped:
        run_in_process(tmp_path)
    assert stopped.value.code == 128 + signal.SIGTERM and stopped.value.step == stops_at
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == stops_at
    assert (40 in val_steps(tmp_path)) == (stops_at > 40)
    monkeypatch.undo()

    run_in_process(tmp_path, "ckpt_path=last")
    assert_same_run(tmp_path, reference)


@pytest.mark.slow
def test_sigterm_during_a_checkpoint_write_completes_it_then_stops(
    tmp_path, reference, monkeypatch
):
    monkeypatch.setattr(torch, "save", interrupting_save(signal.SIGTERM, nth=2))  # step 40's
    with pytest.raises(TrainingStopped) as stopped:
        run_in_process(tmp_path)
    assert stopped.value.step == 41  # the handler only records: the write and step 41 finish
    assert checkpoint_step(tmp_path / "checkpoints" / "step=0000040.ckpt") == 40
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 41
    monkeypatch.undo()

    run_in_process(tmp_path, "ckpt_path=last")
    assert_same_run(tmp_path, reference)


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_leaves_the_previous_last_ckpt(tmp_path, reference):
    code = (
        "import signal, torch\n"
        "from test_preemption import interrupting_save\n"
        "torch.save = interrupting_save(signal.SIGKILL, nth=2)\n"  # step 40's last.ckpt
        "from speechattn.pretrain import main\n"
        "main()\n"
    )
    proc = cli(RUN, tmp_path, code=code)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    checkpoints = tmp_path / "checkpoints"
    (partial,) = checkpoints.glob(f"last.ckpt{TEMP_MARK}*")  # the write that was cut
    assert checkpoint_step(checkpoints / "last.ckpt") == 20  # the previous one, intact
    assert checkpoint_step(checkpoints / "step=0000040.ckpt") == 40

    run_in_process(tmp_path, "ckpt_path=last")
    assert not partial.exists()
    assert_same_run(tmp_path, reference)


def test_a_signal_before_training_starts(tmp_path, monkeypatch):
    """During the validation at start: it finishes, nothing was trained, nothing is saved.
    While fit sets up (before Lightning installs its handlers): stop after the first step."""
    with_callback(monkeypatch, SignalAt("on_validation_start", 0))
    with pytest.raises(TrainingStopped, match="at step 0 .no checkpoint written in this run.; "):
        run_in_process(tmp_path / "validate")
    assert not (tmp_path / "validate" / "checkpoints" / "last.ckpt").exists()
    monkeypatch.undo()

    callback = SignalAt("setup", 0)
    with_callback(monkeypatch, callback)
    with pytest.raises(TrainingStopped) as stopped:
        run_in_process(tmp_path / "setup", "validate_at_start=false")
    assert callback.sent and stopped.value.step == 1
    assert checkpoint_step(tmp_path / "setup" / "checkpoints" / "last.ckpt") == 1


# ----------------------------------------------------------------------------- SLURM


def fake_scontrol(tmp_path: Path, monkeypatch, status: int = 0) -> Path:
    """An `scontrol` first on PATH that appends its arguments to the returned file."""
    calls = tmp_path / "calls"
    (tmp_path / "scontrol").write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\necho "denied" >&2\nexit {status}\n'
    )
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_requeue_calls_scontrol_with_the_job_id(tmp_path, monkeypatch):
    calls = fake_scontrol(tmp_path, monkeypatch)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    assert slurm_job_id() == "777"
    assert requeue_slurm_job(slurm_job_id())
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "700")  # an array task is requeued by array id
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm_job_id() == "700_3"
    assert requeue_slurm_job(slurm_job_id())
    assert calls.read_text() == "requeue 777\nrequeue 700_3\n"
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    monkeypatch.delenv("SLURM_JOB_ID")
    assert slurm_job_id() is None


@pytest.mark.parametrize(
    ("signum", "requeued"),
    [(signal.SIGUSR1, True), (signal.SIGUSR2, True), (signal.SIGTERM, False)],
)
def test_the_time_limit_warnings_requeue_and_sigterm_does_not(
    tmp_path, monkeypatch, signum, requeued
):
    """USR1 (`sbatch --signal=USR1@90`) and USR2 (what Hydra's submitit launcher asks SLURM
    for) requeue the job after the save; SIGTERM (also what `scancel` sends) never does."""
    calls = fake_scontrol(tmp_path, monkeypatch)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    stop = StopOnSignal(tmp_path / "checkpoints")
    stop._on_signal(signum, None)
    trainer = type("Trainer", (), {"global_step": 7, "is_global_zero": True})()
    stopped = stop._stopped(trainer, "ckpt_path=last")
    assert stopped.code == 128 + signum and stopped.step == 7
    assert ("SLURM job 4242 requeued" in stopped.message) == requeued
    assert (calls.read_text() if calls.exists() else "") == ("requeue 4242\n" if requeued else "")


def test_requeue_failures_are_reported_not_raised(tmp_path, monkeypatch, caplog):
    calls = fake_scontrol(tmp_path, monkeypatch, status=1)
    with caplog.at_level(logging.ERROR, logger="speechattn.preemption"):
        assert not requeue_slurm_job("777")
        assert not requeue_slurm_job("777; rm -rf ~")  # never reaches a command line
    assert calls.read_text() == "requeue 777\n"
    assert "scontrol requeue 777 exited with 1: denied" in caplog.text
    assert "not requeueing: '777; rm -rf ~' is not a SLURM job id" in caplog.text
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no scontrol at all
    assert not requeue_slurm_job("777")


def test_a_requeued_job_that_would_start_from_scratch_says_so(tmp_path, monkeypatch):
    warn = warn_if_requeued_from_scratch
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    with pytest.warns(UserWarning, match=r"requeued \(SLURM_RESTART_COUNT=2\).*ckpt_path=last"):
        warn(None, tmp_path)
    warn(tmp_path / "last.ckpt", tmp_path)  # resuming: nothing to say (no warning = no error)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    warn(None, tmp_path)


# ----------------------------------------------------------------------------- DDP


@pytest.mark.slow
def test_sigterm_to_every_ddp_rank_stops_all_at_one_step(tmp_path):
    """SLURM signals every task; Lightning 2.6's own handler deadlocked here (see the module)."""
    ddp = [*RUN, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    reference = cli(ddp, tmp_path / "reference")
    out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, out[-3000:]

    run_dir = tmp_path / "run"
    proc = cli(ddp, run_dir, own_group=True)  # the signal goes to both ranks
    target = run_dir / "checkpoints" / "step=0000020.ckpt"
    deadline = time.time() + 180
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert len(STOPPED.findall(out)) == 1  # rank 0 tells

    resumed = cli([*ddp, "ckpt_path=last"], run_dir)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out[-3000:]
    assert_same_run(run_dir, tmp_path / "reference")


@pytest.mark.slow
def test_a_signal_to_the_process_group_during_extraction_stops_the_run(tiny_corpus, tmp_path):
    """SIGTERM to the whole group (what `timeout`, `scancel` and SLURM's --signal do) while two
    pool workers extract: the workers die, and the run stops promptly as a stop, not a hang
    (multiprocessing.Pool waited forever for the dead workers' results) nor a crash."""
    corpus = Path(shutil.copytree(tiny_corpus, tmp_path / "corpus"))
    cache = tmp_path / "cache"
    args = [f"data.root={corpus}", f"data.cache_dir={cache}", "data.extract_workers=2",
            "trainer.max_steps=2"]  # fmt: skip
    proc = cli(args, tmp_path / "run", own_group=True)
    deadline = time.time() + 180
    while not list(cache.glob("features/splits/*.plan.json")) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    start = time.time()
    out, _ = proc.communicate(timeout=120)
    assert time.time() - start < 60, out[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM at step 0" in out and "resume with:" in out
    assert not list(cache.glob("features/shards/*/*.claim"))

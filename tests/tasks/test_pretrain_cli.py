"""`python -m speechattn.pretrain` in subprocesses: real DDP (gloo, 2 CPU processes), SIGKILL + resume.

The data is the synthetic DataModule of _pretrain_testing.py, plugged in through `data._target_`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _pretrain_testing import SyntheticPretrainData, compose_pretrain

import speechattn
from speechattn.pretrain import run

HERE = Path(__file__).resolve().parent
SMALL = [
    "~data",
    "+data._target_=_pretrain_testing.SyntheticPretrainData",
    "model.net.dim=32",
    "model.net.num_layers=2",
    "model.net.num_heads=2",
    "model.net.ffn_dim=64",
    "model.optimizer.lr=1e-2",
    "progress_bar=none",
    "logger=none",
    "trainer.enable_model_summary=false",
]


def cli(run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",  # tiny model: one thread per process avoids oversubscription
    }
    cmd = [
        sys.executable,
        "-m",
        "speechattn.pretrain",
        *SMALL,
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so a kill takes DDP children too
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["full", "routing"])  # routing: a collective in forward
def test_ddp_with_two_cpu_processes(tmp_path, attention):
    out = finish(
        cli(
            tmp_path,
            f"attention={attention}",
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.max_steps=6",
            "trainer.val_check_interval=3",
            "trainer.log_every_n_steps=3",
        )
    )
    assert "Starting with 2 processes" in out and "gloo" in out
    assert f"upstream.pt written to {tmp_path / 'upstream.pt'}" in out
    up = speechattn.load_upstream(tmp_path / "upstream.pt")
    assert up.metadata["world_size"] == 2 and up.metadata["steps"] == 6
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    steps = [
        "trainer.max_steps=120",
        "checkpoint.every_n_steps=20",
        "trainer.val_check_interval=40",
    ]
    killed = tmp_path / "killed"
    proc = cli(killed, *steps)
    target = killed / "checkpoints" / "step=0000040.ckpt"
    deadline = time.time() + 180
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # let it run on past the checkpoint, as a real crash would
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert target.exists() and not (killed / "upstream.pt").exists(), "killed too late"

    out = finish(cli(killed, *steps, "ckpt_path=last"))
    assert "resuming from" in out

    reference = tmp_path / "reference"
    run(
        compose_pretrain(reference, "~data", *steps, "model.optimizer.lr=1e-2"),
        SyntheticPretrainData(),
    )
    ref = torch.load(reference / "upstream.pt", weights_only=True)
    got = torch.load(killed / "upstream.pt", weights_only=True)
    assert got["metadata"]["steps"] == ref["metadata"]["steps"] == 120
    for k, v in ref["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][k], v, atol=1e-5, rtol=1e-4)


def test_progress_bar_choices_and_step_label():
    from speechattn.tasks.common import StepRichProgressBar, progress_bar

    (bar,) = progress_bar("rich")
    assert isinstance(bar, StepRichProgressBar)
    assert bar._get_train_description(0).strip() == "Pretraining"  # not "Epoch 0/-2"
    assert progress_bar("none") == []
    with pytest.raises(ValueError, match="unknown progress_bar 'fancy'"):
        progress_bar("fancy")

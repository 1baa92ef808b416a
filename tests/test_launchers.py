"""conf/hydra/launcher/: the slurm and local presets compose with every entry point's config,
the SLURM job script carries their resources, and a failed job leaves a multirun going."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from speechattn import CONFIG_DIR
from speechattn.config import register, run_cli
from speechattn.tasks.pretrain import NonFiniteLossError


def compose_with_hydra(config_name: str, overrides: list[str]) -> DictConfig:
    """`conf/<config_name>.yaml` with its `hydra` node (the launcher) as a multirun sees it."""
    register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name, overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize(
    "config_name, extra",
    [("pretrain", ["experiment=paper", "data.root=/data/LibriSpeech"]), ("downstream", [])],
)
def test_slurm_preset_composes_with_settings_from_the_command_line(
    config_name: str, extra: list[str]
) -> None:
    overrides = ["hydra/launcher=slurm", *extra]
    launcher = compose_with_hydra(config_name, overrides).hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.partition is None  # the cluster's default partition
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (1, 1, 1)
    assert (launcher.cpus_per_task, launcher.mem_gb, launcher.timeout_min) == (9, 64, 1440)
    assert (launcher.signal_delay_s, launcher.max_num_timeout) == (120, 5)

    overrides += [
        "hydra.launcher.partition=gpu",
        "hydra.launcher.timeout_min=4320",
        "hydra.launcher.gpus_per_node=2",
        "hydra.launcher.account=speech",
    ]
    launcher = compose_with_hydra(config_name, overrides).hydra.launcher
    assert (launcher.partition, launcher.timeout_min) == ("gpu", 4320)
    assert (launcher.gpus_per_node, launcher.account) == (2, "speech")


def test_local_preset_outlives_the_plugins_hour() -> None:
    launcher = compose_with_hydra("pretrain", ["hydra/launcher=local"]).hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.LocalLauncher")
    assert launcher.timeout_min == 10080 and launcher.gpus_per_node is None


def test_analyze_takes_the_presets_too() -> None:
    cfg = compose_with_hydra("analyze", ["analysis=heads", "hydra/launcher=slurm"])
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "slurm"


@pytest.mark.slow
def test_slurm_multirun_submits_one_array_with_the_presets_resources(tmp_path: Path) -> None:
    """`python -m speechattn.pretrain -m attention=full,ldsa hydra/launcher=slurm` up to the
    submission: a fake `sbatch` keeps the job script it is given and refuses it (submitit
    also looks for `srun`, which the job script would call)."""
    bin_dir, script = tmp_path / "bin", tmp_path / "submitted.sh"
    bin_dir.mkdir()
    fakes = {
        "sbatch": f'cp "$1" {script}\necho "sbatch: no cluster here" >&2\nexit 1',
        "srun": "exit 1",
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    sweep = tmp_path / "sweep"
    argv = [
        sys.executable,
        "-m",
        "speechattn.pretrain",
        "--multirun",
        "attention=full,ldsa",
        "hydra/launcher=slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.timeout_min=4320",
        f"hydra.sweep.dir={sweep}",
    ]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("SUBMITIT_PREEMPT_SIGNAL", None)  # submitit's default signal: USR2
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and script.is_file(), done.stderr[-2000:]
    lines = script.read_text().splitlines()
    for flag in (
        "--array=0-1%2",  # one job per variant, both at once (array_parallelism 256)
        "--partition=gpu",
        "--time=4320",
        "--gpus-per-node=1",
        "--cpus-per-task=9",
        "--mem=64GB",
        "--ntasks-per-node=1",
        "--signal=USR2@120",  # submitit's requeue signal, 120 s before the time limit
        f"--output={sweep}/.submitit/%A_%a/%A_%a_0_log.out",
    ):
        assert f"#SBATCH {flag}" in lines, (flag, lines)


def test_run_cli_raises_in_a_multirun_and_exits_in_a_single_run() -> None:
    """In a multirun the error is raised, so Hydra marks that job failed and runs the others
    (an exit would end the basic launcher's whole sweep); a single run exits with status 1."""

    def diverged(cfg: DictConfig) -> dict:
        raise NonFiniteLossError("loss is NaN")

    for mode, expected in (("MULTIRUN", NonFiniteLossError), ("RUN", SystemExit)):
        cfg = compose_with_hydra("pretrain", [f"hydra.mode={mode}"])
        HydraConfig.instance().set_config(cfg)
        try:
            with pytest.raises(expected) as raised:
                run_cli(diverged, cfg)
        finally:
            HydraConfig.instance().cfg = None
        if expected is SystemExit:
            assert raised.value.code == 1

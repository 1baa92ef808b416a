"""A run never writes through a symbolic link planted in its folder (which would overwrite a
file outside it): Hydra's own files are refused before Hydra opens them (`RunFolderGuard`),
and the files the run writes itself are replaced by rename or appended with O_NOFOLLOW."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from speechattn.config import RunFolderGuard
from speechattn.errors import OutputExistsError
from speechattn.tasks.common import MetricsCSV
from speechattn.utils import append_text


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "outside.txt"
    path.write_text("keep me\n")
    return path


def _plant(link, target):
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


@pytest.mark.parametrize(
    "name", [".hydra/config.yaml", ".hydra", "pretrain.log", "config.yaml", "logs/metrics.csv"]
)
def test_the_guard_refuses_a_link_where_hydra_or_the_run_writes(tmp_path, victim, name, capsys):
    run = tmp_path / "run"
    _plant(run / name, victim)
    config = OmegaConf.create({"hydra": {"run": {"dir": str(run)}, "job": {"name": "pretrain"}}})
    with pytest.raises(SystemExit) as exit_:
        RunFolderGuard().on_run_start(config=config)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert f"{run / name} is a symbolic link (to {victim})" in err and "remove the link" in err
    assert victim.read_text() == "keep me\n"


def test_the_guard_checks_the_job_folders_of_a_sweep(tmp_path, victim, capsys):
    sweep = tmp_path / "sweep"
    (sweep / "full_0").mkdir(parents=True)
    _plant(sweep / "ldsa_1" / "metrics.csv", victim)
    config = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(sweep)}, "job": {"name": "pretrain"}}}
    )
    with pytest.raises(SystemExit):
        RunFolderGuard().on_multirun_start(config=config)
    assert "ldsa_1/metrics.csv is a symbolic link" in capsys.readouterr().err


def test_a_clean_folder_passes(tmp_path):
    config = OmegaConf.create(
        {"hydra": {"run": {"dir": str(tmp_path / "new")}, "job": {"name": "x"}}}
    )
    RunFolderGuard().on_run_start(config=config)  # nothing there yet: no error


@pytest.mark.slow
def test_the_command_line_refuses_before_hydra_writes(tmp_path, victim):
    run = tmp_path / "run"
    _plant(run / ".hydra" / "hydra.yaml", victim)
    done = subprocess.run(
        [sys.executable, "-m", "speechattn.pretrain", f"hydra.run.dir={run}", "debug=fdr"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "hydra.yaml is a symbolic link" in done.stderr
    assert victim.read_text() == "keep me\n" and not (run / "config.yaml").exists()


def test_metrics_rows_never_go_through_a_link(tmp_path, victim):
    link = tmp_path / "metrics.csv"
    _plant(link, victim)
    metrics = MetricsCSV(link)
    trainer = SimpleNamespace(is_global_zero=True, global_step=0)
    with pytest.raises(OutputExistsError, match="is a symbolic link"):
        metrics.on_train_start(trainer, None)
    with pytest.raises(OutputExistsError, match="is a symbolic link"):
        append_text(link, "1,2\n")
    assert victim.read_text() == "keep me\n"


def test_metrics_rows_are_appended_to_the_runs_own_file(tmp_path):
    path = tmp_path / "metrics.csv"
    metrics = MetricsCSV(path)
    trainer = SimpleNamespace(
        is_global_zero=True, global_step=0, callback_metrics={"val_loss": 0.5}
    )
    metrics.on_train_start(trainer, None)
    metrics._write(trainer, ("val_loss",))
    lines = path.read_text().splitlines()
    assert lines[0].startswith("step,train_loss,val_loss") and lines[1].startswith("0,,0.5,")

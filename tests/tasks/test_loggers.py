"""Every option of the `logger` group, for both training jobs: it composes, instantiates and
writes where conf/logger/<name>.yaml says, and the job's own files (pretraining's metrics.csv
and upstream.pt, downstream's result.json and logs/metrics.csv) are written whatever the logger.

wandb and mlflow are optional extras (`pip install speechattn[wandb]`, `[mlflow]`): their cases
are skipped when the package is absent. wandb runs offline: nothing goes over the network.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _pretrain_testing import SyntheticPretrainData, compose_pretrain
from test_downstream_run import compose_downstream

from speechattn.data import DataConfig
from speechattn.tasks.downstream import run as run_downstream
from speechattn.tasks.pretrain import run as run_pretrain


def written(name: str, out: Path) -> list[Path]:
    """The files logger `name` writes under the run dir `out`, where its YAML documents them."""
    patterns = {
        "tensorboard": "tensorboard/events.out.tfevents.*",
        "csv": "csv/metrics.csv",
        "wandb": "wandb/offline-run-*/run-*.wandb",
        "mlflow": "mlruns/*/*/metrics/*",
        "none": "",
    }
    return sorted(out.glob(patterns[name])) if patterns[name] else []


LOGGER_DIRS = ("tensorboard", "csv", "wandb", "mlruns")


def logger_case(name: str):
    marks = []
    if name in ("wandb", "mlflow"):
        marks = [pytest.mark.skipif(not _installed(name), reason=f"pip install speechattn[{name}]")]
    return pytest.param(name, marks=marks)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


LOGGERS = [logger_case(n) for n in ("tensorboard", "csv", "wandb", "mlflow", "none")]


def check_logger_output(name: str, out: Path, metric: str) -> None:
    files = written(name, out)
    if name == "none":
        assert not any((out / d).exists() for d in LOGGER_DIRS)
        return
    assert files, f"logger={name} wrote nothing under {out}"
    if name == "csv":
        assert metric in files[0].read_text().splitlines()[0].split(",")
    if name == "mlflow":
        assert metric in {p.name for p in files}
    others = {d for d in LOGGER_DIRS if (out / d).exists()}
    assert others == {"mlruns" if name == "mlflow" else name}


@pytest.mark.parametrize("name", LOGGERS)
def test_pretraining_logs_to_each_logger(name: str, tmp_path: Path) -> None:
    cfg = compose_pretrain(tmp_path, "~data", f"logger={name}")  # synthetic data below
    result = run_pretrain(cfg, datamodule=SyntheticPretrainData())
    assert result["steps"] == 8 and Path(result["upstream"]).is_file()
    assert (tmp_path / "metrics.csv").is_file()
    check_logger_output(name, tmp_path, "train_loss")


@pytest.mark.parametrize("name", LOGGERS)
def test_downstream_logs_to_each_logger(
    name: str, tmp_path: Path, tiny_data_config: DataConfig
) -> None:
    out = tmp_path / "run"
    cfg = compose_downstream(out, tiny_data_config, "upstream=mel", f"logger={name}")
    result = run_downstream(cfg)
    assert (out / "result.json").is_file() and 0.0 <= result["test_accuracy"] <= 1.0
    header = (out / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"dev_acc", "train_loss"} <= set(header)
    check_logger_output(name, out, "dev_acc")

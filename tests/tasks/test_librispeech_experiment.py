"""`data=librispeech` alone keeps the tiny quick-start experiment: the run says so, naming
`experiment=paper`, before it does anything else."""

from __future__ import annotations

import logging
import sys

import pytest
from hydra import compose, initialize_config_dir

import speechattn.pretrain as entry
from speechattn import CONFIG_DIR
from speechattn.config import register


def hydra_compose(*overrides: str):
    register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("pretrain", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize(
    "overrides, warns",
    [
        (["data=librispeech", "data.root=/data/LibriSpeech"], True),
        (["data=librispeech", "data.root=/x", "experiment=paper"], False),
        (["data=librispeech", "data.root=/x", "experiment=tiny"], False),  # asked for
        (["data=librispeech", "data.root=/x", "~experiment"], False),
        (["data.corpus=librispeech", "data.root=/x"], True),
        ([], False),  # the built-in corpus is what tiny is for
    ],
)
def test_warning_names_the_paper_experiment(overrides, warns):
    cfg = hydra_compose(*overrides)
    found = entry.tiny_experiment_warning(cfg, cfg.hydra.runtime.choices, cfg.hydra.overrides.task)
    assert (found is not None) == warns
    if warns:
        assert "add experiment=paper" in found and "experiment=tiny" in found


def test_the_command_line_logs_it_before_running(tmp_path, monkeypatch, caplog):
    started = []
    monkeypatch.setattr(entry, "run", lambda cfg: started.append(cfg.model.name) or {})
    argv = ["speechattn.pretrain", "data=librispeech", "data.root=/data/LibriSpeech",
            f"hydra.run.dir={tmp_path}", "hydra/job_logging=none", "hydra/hydra_logging=none"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with caplog.at_level(logging.WARNING, logger="speechattn.pretrain"):
        entry.main()
    assert started == ["aalbert_tiny"]
    assert any("add experiment=paper" in r.getMessage() for r in caplog.records)

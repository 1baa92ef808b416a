"""recipes/attention_study.py: every registered variant, resumable skips, scale switch."""

import importlib.util
import sys
from pathlib import Path

import pytest

from speechattn.attention import available

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "attention_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("attention_study", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_covers_every_variant_and_task(study, tmp_path: Path, capsys) -> None:
    assert study.main(["--scale", "tiny", "--out", str(tmp_path), "--dry-run", "--no-bench"]) == 0
    out = capsys.readouterr().out
    for variant in available():
        assert f"attention={variant} " in out
        assert f"downstream/{variant} " in out
    assert "upstream=mel" in out and "speechattn.report" in out
    assert out.count("speechattn.analyze heads upstream=") == len(available())
    assert "heads downstream=" not in out  # tiny: the pretraining loss only
    assert (
        out.count("task=speaker_utterance,speaker_frame,phone_1hidden,phone_2hidden")
        == len(available()) + 1
    )


def test_finished_work_is_skipped(study, tmp_path: Path, capsys) -> None:
    (tmp_path / "pretrain" / "full").mkdir(parents=True)
    (tmp_path / "pretrain" / "full" / "upstream.pt").write_bytes(b"x")
    for task in ("speaker_utterance", "phone_1hidden"):
        (tmp_path / "downstream" / "full" / task).mkdir(parents=True)
        (tmp_path / "downstream" / "full" / task / "result.json").write_text("{}")
    study.main(
        ["--out", str(tmp_path), "--dry-run", "--no-bench", "--no-mel", "--variants", "full"]
    )
    out = capsys.readouterr().out
    assert "pretrain full: done, skipping" in out
    assert "task=speaker_frame,phone_2hidden " in out


def test_paper_scale_needs_librispeech(study, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("LIBRISPEECH", raising=False)
    with pytest.raises(SystemExit, match="LibriSpeech root"):
        study.main(["--scale", "paper", "--out", str(tmp_path), "--dry-run"])
    scale = study.scale_overrides("paper", "/data/LibriSpeech")
    assert (
        "experiment=paper" in scale.pretrain and "data.root=/data/LibriSpeech" in scale.downstream
    )


def test_unknown_variant_is_refused(study, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown variant"):
        study.main(["--out", str(tmp_path), "--dry-run", "--variants", "nope"])


def test_parallel_jobs_share_the_cores_and_failures_are_recorded(
    study, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(study.os, "cpu_count", lambda: 4)
    runner = study.Study(tmp_path, study.Scale(jobs=2))
    show = "import os; print('threads', os.environ['OMP_NUM_THREADS'])"
    assert runner.command("show", [sys.executable, "-c", show])
    assert "threads 2" in (tmp_path / "logs" / "show.log").read_text()
    assert not runner.command("quiet", [sys.executable, "-c", "raise SystemExit(4)"], False)
    assert not runner.command("loud", [sys.executable, "-c", "raise SystemExit(3)"])
    assert runner.failures == [f"loud: exit 3, log {tmp_path / 'logs' / 'loud.log'}"]


def test_jobs_must_be_positive(study, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--jobs must be at least 1, got 0"):
        study.main(["--out", str(tmp_path), "--dry-run", "--jobs", "0"])


def test_head_analyses_per_variant(study, tmp_path: Path, capsys) -> None:
    args = ["--out", str(tmp_path), "--dry-run", "--no-bench", "--no-mel", "--variants", "ldsa"]
    args += ["--heads", "pretrain,phone_1hidden"]
    assert study.main(args) == 0
    out = capsys.readouterr().out
    pretrain_dir = tmp_path / "heads" / "ldsa" / "pretrain"
    assert f"upstream={tmp_path / 'pretrain' / 'ldsa' / 'upstream.pt'}" in out
    assert f"hydra.run.dir={pretrain_dir}" in out
    assert f"downstream={tmp_path / 'downstream' / 'ldsa' / 'phone_1hidden'}" in out
    assert study.main([*args, "--heads", ""]) == 0
    assert "speechattn.analyze" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown head analysis"):
        study.main([*args, "--heads", "pretrain,nope"])

"""The SUPERB table of `python -m speechattn.report` from superb_result.json files."""

from __future__ import annotations

from speechattn.report.build import make_report
from speechattn.tasks.records import SuperbResult


def result(
    task, value, upstream="speechattn", attention="ldsa", quick=True, created="2026-01-01",
    run="run", selection="weighted sum",
):  # fmt: skip
    metric, higher = ("per", False) if task == "ctc" else ("accuracy", True)
    ckpt = f"/{run}/upstream.pt" if upstream == "speechattn" else None
    return SuperbResult(
        task=task, metric=metric, value=value, higher_is_better=higher, split="test",
        upstream=upstream, upstream_ckpt=ckpt, attention=attention, quick=quick, steps=300,
        checkpoint="dev-best.ckpt", created=created, selection=selection,
    )  # fmt: skip


def test_superb_table_compares_upstreams_with_baselines(tmp_path):
    runs = {
        "a": result("speech_commands", 0.61),
        "a-old": result("speech_commands", 0.10, created="2025-01-01"),  # superseded
        "b": result("ctc", 0.42),
        "c": result("speech_commands", 0.53, "fbank_no_cmvn", "fbank_no_cmvn"),
        "d": result("ctc", 0.38, "fbank_no_cmvn", "fbank_no_cmvn"),
        "e": result("voxceleb1", 0.81, quick=False),
    }
    for name, run in runs.items():
        (tmp_path / name).mkdir()
        run.write(tmp_path / name)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "superb_result.json").write_text("{}")
    report = make_report(tmp_path, out=tmp_path / "report")
    table = (tmp_path / "report" / "superb.md").read_text()
    assert "| upstream | kind | KS acc ↑ | SID acc ↑ | PR PER ↓ |" in table
    assert "| ldsa (run run) (quick) | speechattn | **0.6100** | – | 0.4200 |" in table
    assert "| ldsa (run run) | speechattn | – | **0.8100** | – |" in table
    assert "| fbank_no_cmvn (quick) | baseline | 0.5300 | – | **0.3800** |" in table  # lower PER
    assert any("bad/superb_result.json" in n for n in report.notes)
    readme = (tmp_path / "report" / "README.md").read_text()
    assert readme.startswith("# SUPERB results") and "superb.md" in readme
    # a folder of SUPERB results only: no study tables, no "runs missing"
    assert not (tmp_path / "report" / "table2.md").exists() and "missing" not in readme


def test_each_upstream_run_and_layer_choice_is_its_own_row(tmp_path):
    """Another pretraining run of the same variant (seed, steps) and another layer of the same
    upstream are rows of their own, never replacing each other."""
    runs = {
        "seed0": result("speech_commands", 0.61, run="ldsa-seed0"),
        "seed1": result("speech_commands", 0.58, run="ldsa-seed1"),
        "layer2": result("speech_commands", 0.55, run="ldsa-seed0", selection="layer 2"),
    }
    for name, run in runs.items():
        (tmp_path / name).mkdir()
        run.write(tmp_path / name)
    make_report(tmp_path, out=tmp_path / "report")
    table = (tmp_path / "report" / "superb.md").read_text()
    assert "| ldsa (run ldsa-seed0) (quick) | speechattn | **0.6100** |" in table
    assert "| ldsa (run ldsa-seed1) (quick) | speechattn | 0.5800 |" in table
    assert "| ldsa (run ldsa-seed0, layer 2) (quick) | speechattn | 0.5500 |" in table


def test_no_superb_results_no_table(tmp_path):
    make_report(tmp_path, out=tmp_path / "report")
    assert not (tmp_path / "report" / "superb.md").exists()


def test_a_folder_of_unreadable_superb_results_gets_a_report_naming_them(tmp_path):
    """No result.json and no readable superb_result.json: the report is written, with the
    broken files named, instead of failing on the SUPERB table it cannot build."""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "superb_result.json").write_text("{}")
    report = make_report(tmp_path, out=tmp_path / "report")
    assert any("bad/superb_result.json" in n for n in report.notes)
    assert "bad/superb_result.json" in (tmp_path / "report" / "README.md").read_text()
    assert not (tmp_path / "report" / "superb.md").exists()

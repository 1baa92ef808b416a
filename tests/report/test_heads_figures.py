"""Head-analysis figures and the report hook, from heads.json files alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speechattn.report.figures import (
    head_figures,
    head_report,
    head_summary_markdown,
    overlay_pruning_curves,
    write_head_figures,
)
from speechattn.tasks.records import KIND, find_heads, read_heads, write_heads


def fake_heads(attention: str, task: str = "pretrain", L: int = 2, h: int = 3) -> dict:
    """A schema-valid heads.json object with made-up numbers."""
    accuracy = task != "pretrain"
    base = 0.8 if accuracy else 0.5
    grid = [[0.1 * (i + 1) + 0.05 * j for j in range(h)] for i in range(L)]
    n = L * h
    points = []
    for k in range(n + 1):
        mask = [[0 if i * h + j < k else 1 for j in range(h)] for i in range(L)]
        metric = base - 0.05 * k if accuracy else base + 0.05 * k
        points.append(
            {"num_masked": k, "fraction": k / n, "metric": metric, "newly_masked": [], "mask": mask}
        )
    delta = [[0.01 * (j - 1) for j in range(h)] for _ in range(L)]
    return {
        "schema_version": 1,
        "kind": KIND,
        "task": task,
        "metric": "accuracy" if accuracy else "l1_loss",
        "higher_is_better": accuracy,
        "base_metric": base,
        "num_layers": L,
        "num_heads": h,
        "attention": attention,
        "upstream": f"/runs/{attention}/upstream.pt",
        "importance": {
            "per": "utterance",
            "raw": grid,
            "normalized": grid,
            "signed": grid,
            "order": [[i, j] for i in range(L) for j in range(h)],
        },
        "ablation": {
            "single": {"metric": grid, "delta": delta},
            "keep_only": {"metric": grid, "delta": delta},
            "layer": {"metric": [base] * L, "delta": [0.0] * L},
        },
        "pruning": {"step": 0.1, "recompute": False, "keep_one_per_layer": False, "points": points},
        "seed": 0,
        "code_version": "test",
    }


def test_write_and_read_heads_roundtrip(tmp_path: Path) -> None:
    data = fake_heads("full")
    path = write_heads(data, tmp_path / "run")
    assert path.name == "heads.json" and read_heads(path) == data
    assert read_heads(tmp_path / "run") == data  # a run dir works too
    assert find_heads(tmp_path) == [path]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(kind="other"), "not a head analysis"),
        (lambda d: d.update(schema_version=9), "schema version 9"),
        (lambda d: d.pop("importance"), "lacks required field"),
        (lambda d: d["importance"]["normalized"].pop(), "2 x 3 matrix"),
        (lambda d: d["pruning"].update(points=[]), "non-empty list"),
    ],
)
def test_invalid_heads_json_is_refused_naming_the_file(tmp_path: Path, change, message) -> None:
    data = fake_heads("full")
    change(data)
    path = tmp_path / "heads.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as e:
        read_heads(path)
    assert str(path) in str(e.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable heads.json"):
        read_heads(path)


def test_figures_of_one_analysis(tmp_path: Path) -> None:
    files = head_figures(fake_heads("ldsa"), tmp_path)
    assert [p.name for p in files] == [
        "heads_importance.png",
        "heads_ablation.png",
        "heads_pruning.png",
    ]
    assert all(p.stat().st_size > 1000 for p in files)
    no_extras = fake_heads("ldsa")
    no_extras["ablation"] = {"single": None, "keep_only": None, "layer": None}
    no_extras["pruning"] = None
    assert [p.name for p in head_figures(no_extras, tmp_path / "b")] == ["heads_importance.png"]


def test_report_figures_overlay_and_summary(tmp_path: Path) -> None:
    results = tmp_path / "results"
    paths = [
        write_heads(fake_heads("full"), results / "a"),
        write_heads(fake_heads("syn_fixed", task="speaker_utterance"), results / "b"),
    ]
    written = head_report(results, tmp_path / "report")
    names = sorted(p.name for p in written)
    assert names == sorted(
        [
            *(f"heads_full_pretrain_{k}.png" for k in ("importance", "ablation", "pruning")),
            *(
                f"heads_syn_fixed_speaker_utterance_{k}.png"
                for k in ("importance", "ablation", "pruning")
            ),
            "fig_heads_pruning.png",
            "heads.md",
        ]
    )
    assert "| syn_fixed | speaker_utterance | accuracy | 0.8000 |" in head_summary_markdown(paths)
    overlay = overlay_pruning_curves(paths, tmp_path / "overlay.png", relative=True)
    assert overlay is not None and overlay.stat().st_size > 1000
    assert head_report(tmp_path / "empty", tmp_path / "r2") == []
    no_curve = fake_heads("full")
    no_curve["pruning"] = None
    lone = write_heads(no_curve, tmp_path / "lone")
    assert overlay_pruning_curves([lone], tmp_path / "none.png") is None


def test_repeated_names_get_a_counter(tmp_path: Path) -> None:
    data = fake_heads("full")
    data["ablation"] = {"single": None, "keep_only": None, "layer": None}
    data["pruning"] = None
    a, b = write_heads(data, tmp_path / "a"), write_heads(data, tmp_path / "b")
    files = write_head_figures([a, b.parent], tmp_path / "fig")
    assert [p.name for p in files] == [
        "heads_full_pretrain_importance.png",
        "heads_full_pretrain_2_importance.png",
    ]

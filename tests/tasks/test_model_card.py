"""The model card (README.md + loss_curve.png) written beside every pretrained upstream.pt."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import yaml

import speechattn
from speechattn.tasks.common import read_metrics
from speechattn.tasks.pretrain.model_card import median_metric, write_model_card


def read_card(path: Path) -> tuple[dict, str]:
    text = path.read_text()
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def test_a_pretraining_run_writes_a_model_card(pretrained_tiny_run: Path):
    card, body = read_card(pretrained_tiny_run / "README.md")
    upstream = pretrained_tiny_run / "upstream.pt"
    up = speechattn.load_upstream(upstream)
    rows = read_metrics(pretrained_tiny_run / "metrics.csv")
    trained = [r["train_loss"] for r in rows if not math.isnan(r["train_loss"])]
    validated = [r["val_loss"] for r in rows if not math.isnan(r["val_loss"])]

    assert card["library_name"] == "speechattn" and card["license"] == "mit"
    assert card["attention"] == "full" and card["attention_options"] == {}
    assert "attention-full" in card["tags"]
    assert card["model"]["parameters"] == up.metadata["num_params"] > 0
    assert (card["model"]["dim"], card["model"]["num_layers"], card["model"]["num_heads"]) == (
        32,
        2,
        4,
    )
    assert card["model"]["preset"] == "aalbert_tiny"
    assert card["steps"] == 6 and card["corpus"] == "embedded"
    summary = up.metadata["data_summary"]
    assert card["train_utterances"] == summary["train_utterances"] > 0
    # 4 speakers x 6 utterances of 2-8 s, about 80 % of them in the training split
    assert 0.5 / 60 < card["train_hours"] < 3.5 / 60
    assert card["train_hours"] == round(summary["train_seconds"] / 3600, 3)
    # train_loss is the real last training loss (it used to be None in every run)
    assert up.metadata["train_loss"] is not None
    assert card["final_train_loss"] == pytest.approx(trained[-1], rel=1e-5)
    assert up.metadata["train_loss"] == pytest.approx(trained[-1], rel=1e-5)
    assert card["final_val_loss"] == pytest.approx(validated[-1], rel=1e-5)
    assert card["frames_per_s"] == round(median_metric(rows, "frames_per_s")) > 0
    assert card["data_wait"] == pytest.approx(up.metadata["data_wait"], abs=1e-4)
    assert 0 <= card["data_wait"] < 1
    assert card["precision"] == "32-true" == up.metadata["precision"]
    assert card["device"].startswith("cpu: ")
    assert card["code_version"] == up.metadata["code_version"]
    assert card["upstream"] == "upstream.pt"
    assert card["upstream_sha256"] == hashlib.sha256(upstream.read_bytes()).hexdigest()

    assert "![training and validation loss](loss_curve.png)" in body
    for how in ("speechattn.load_upstream(", "torch.hub.load(", "UpstreamExpert("):
        assert how in body
    image = plt.imread(pretrained_tiny_run / "loss_curve.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_median_metric():
    nan = math.nan
    rows = [{"frames_per_s": v} for v in (nan, 30.0, 10.0, 20.0, 40.0)]
    assert median_metric(rows, "frames_per_s") == 25.0
    assert median_metric(rows[:4], "frames_per_s") == 20.0
    assert median_metric([{"frames_per_s": nan}], "frames_per_s") is None


def test_card_writes_are_atomic(pretrained_tiny_run: Path, tmp_path: Path, monkeypatch):
    upstream = tmp_path / "upstream.pt"
    upstream.write_bytes((pretrained_tiny_run / "upstream.pt").read_bytes())
    rows = read_metrics(pretrained_tiny_run / "metrics.csv")
    card = write_model_card(upstream, rows, license="cc-by-4.0")
    assert read_card(card)[0]["license"] == "cc-by-4.0"
    before = card.read_text()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_bytes", fail)
    with pytest.raises(OSError, match="disk full"):
        write_model_card(upstream, [], license="mit")
    assert card.read_text() == before  # the old card survives a failed write
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md",
        "loss_curve.png",
        "upstream.pt",
    ]


def test_card_of_a_missing_upstream_names_it(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        write_model_card(tmp_path / "nowhere.pt", [])

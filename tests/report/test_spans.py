"""The learned-spans table of adaptive_span upstreams in the report."""

import csv
import json
from pathlib import Path

import torch
from test_report import fake_result

from speechattn.data import Normalizer
from speechattn.model.aalbert import aalbert
from speechattn.model.upstream import save_upstream, upstream_state
from speechattn.report.build import make_report
from speechattn.report.results import collect
from speechattn.report.tables import span_table


def _adaptive_span_results(tmp_path: Path, shared: bool) -> Path:
    model = aalbert(
        feature_dim=8, dim=16, num_layers=2, num_heads=2, ffn_dim=32, shared=shared,
        attention="adaptive_span", attention_options={"max_span": 40, "ramp": 4},
    )  # fmt: skip
    for depth, layer in enumerate(model.encoder.layers):
        with torch.no_grad():  # "learned" spans: 10, 20 frames (+ 4 per depth when unshared)
            layer.attention.span_fraction.copy_(torch.tensor([0.25, 0.5]) + 0.1 * depth)
    upstream = save_upstream(
        tmp_path / "pretrain" / "upstream.pt",
        upstream_state(
            model, Normalizer(torch.zeros(8), torch.ones(8)), {"n_mels": 8}, {"steps": 1}
        ),
    )
    root = tmp_path / "results"
    fake_result(root, "mel", "speaker_utterance", 0.1)
    for task in ("speaker_utterance", "phone_1hidden"):  # one upstream, probed twice
        path = fake_result(root, "adaptive_span", task, 0.7)
        data = json.loads(path.read_text())
        data["upstream"] = str(upstream)
        path.write_text(json.dumps(data))
    return root


def test_span_table_per_layer_and_head(tmp_path: Path) -> None:
    root = _adaptive_span_results(tmp_path, shared=False)
    table = span_table(collect(root))
    assert table is not None and table.header[1:] == ["layer", "head 0", "head 1", "mean (ms)"]
    assert [r[1:4] for r in table.rows] == [[1, 10.0, 20.0], [2, 14.0, 24.0]]
    assert abs(table.rows[0][4] - 15 * 30) < 1e-6  # mean span 15 frames of 30 ms


def test_report_writes_spans_of_a_shared_upstream(tmp_path: Path) -> None:
    root = _adaptive_span_results(tmp_path, shared=True)
    report = make_report(root)
    assert (root / "spans.md").is_file(), report.notes
    rows = list(csv.reader((root / "spans.csv").open()))
    assert [r[1:4] for r in rows[1:]] == [["1", "10.0", "20.0"], ["2", "10.0", "20.0"]]
    assert "spans.md" in (root / "README.md").read_text()


def test_no_spans_without_adaptive_span(tmp_path: Path) -> None:
    root = tmp_path / "results"
    fake_result(root, "full", "speaker_utterance", 0.5)
    make_report(root)
    assert not (root / "spans.md").exists()

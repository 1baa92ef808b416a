"""`python -m speechattn.bench features` runs end to end and reports its numbers."""

from __future__ import annotations

import json

from speechattn.bench import features


def test_features_benchmark_smoke(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "bench.json"
    features.main(
        ["--root", str(tiny_corpus), "--workers", "1", "--min-seconds", "0.05", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert "real time" in printed and "assumes a tiny model" in printed
    r = json.loads(out.read_text())
    assert r["utterances"] == 24 and r["extraction"]["x_real_time"] > 0  # a figure, not a target
    assert r["load_batches"]["frames_per_s"] > 0 and r["load_vs_consumer"] > 0

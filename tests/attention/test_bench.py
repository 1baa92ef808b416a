"""Smoke test of `python -m speechattn.bench attention` on tiny sizes."""

from __future__ import annotations

import json

from speechattn.bench import attention as bench


def test_bench_writes_json_and_png(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = [
        "--lengths",
        "16",
        "32",
        "--dim",
        "32",
        "--heads",
        "4",
        "--reps",
        "1",
        "--json",
        str(path),
    ]
    bench.main([*argv, "--variants", "ldsa", "xbox", "syn_random", "--threads", "1"])
    out = json.loads(path.read_text())
    assert set(out["variants"]) == {"full", "ldsa", "xbox", "syn_random"}
    assert set(out["baselines"]) == {"sdpa_mha", "sdpa_kernel"}
    ldsa = out["variants"]["ldsa"]
    assert set(ldsa["time_ms"]) == {"16", "32"} and ldsa["complexity"].startswith("training")
    assert (
        ldsa["keys_attended"]["32"] == 15 - 7 * 8 / 32
        and out["variants"]["xbox"]["keys_attended"]["16"] == 16
    )
    assert "attention_ms" in out["variants"]["xbox"] and ldsa["params"] > 0
    assert out["targets"] and (tmp_path / "bench.png").exists()
    assert "speed-up vs full" in capsys.readouterr().out

"""Smoke test of `python -m speechattn.bench attention` on tiny sizes."""

from __future__ import annotations

import json

from speechattn.bench import attention as bench

# two tiny lengths, one timed step per case
TINY = ["--lengths", "16", "32", "--dim", "32", "--heads", "4", "--reps", "1", "--min-time", "0"]


def test_bench_writes_json_and_png(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = [*TINY, "--json", str(path)]
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
    assert out["variants"]["full"]["kernels"]["32"] > 0
    assert out["targets"] and (tmp_path / "bench.png").exists()
    assert "speed-up vs full" in capsys.readouterr().out


def test_cases_that_would_not_fit_in_memory_are_skipped_and_recorded(monkeypatch, capsys):
    """A case whose peak at the previous length, times the length ratio squared, exceeds the
    memory available is never built; the others still run."""

    def fake_peak(fn, device):  # syn_random's warm-up peaks at 100 MiB, the rest at 1
        fn()
        return 100.0 if fn.__self__.name == "syn_random" else 1.0  # fn: a Case's step

    monkeypatch.setattr(bench, "peak_memory", fake_peak)
    monkeypatch.setattr(bench, "available_memory", lambda device: 300.0)  # 0.8 x 300 = 240
    out = bench.run(
        bench.parse([*TINY, "--variants", "syn_random", "--no-memory", "--threads", "1"])
    )
    syn = out["variants"]["syn_random"]
    assert set(syn["time_ms"]) == {16} and "predicted peak 400 MiB" in syn["errors"][32]
    assert set(out["variants"]["full"]["time_ms"]) == {16, 32}
    assert "T=32 syn_random: skipped (predicted peak 400 MiB, 300 MiB available)" in (
        capsys.readouterr().err
    )


def test_short_steps_are_timed_more_often(monkeypatch):
    """Each length's cases get --reps steps at least, more when `full`'s step is short enough
    that --reps of them take less than --min-time; the counts are recorded."""
    from speechattn.bench.attention import Case

    monkeypatch.setattr(bench, "matmul_peak", lambda **kwargs: 1e11)  # not under test here
    monkeypatch.setattr(Case, "time_step", lambda self, clock: 10.0)  # every step 10 ms
    argv = ["--lengths", "16", "--dim", "32", "--heads", "4", "--threads", "1"]
    args = ["--variants", "ldsa", "--no-memory", "--no-baselines", "--reps", "2"]
    quick = bench.run(bench.parse([*argv, *args, "--min-time", "0"]))
    timed = bench.run(bench.parse([*argv, *args, "--min-time", "0.2"]))
    assert quick["meta"]["reps"] == {16: 2}
    assert timed["meta"]["reps"][16] == 20  # 0.2 s of 10 ms steps


def test_missed_targets_say_why(monkeypatch, capsys):
    """With a limit nothing can meet, every missed target explains itself from measurements:
    a two-kernel variant's other kernel is timed too, LSH reports its selection overhead, a
    one-kernel variant says so."""
    monkeypatch.setattr(bench, "SLOWDOWN_LIMIT", 0.0)
    monkeypatch.setattr(bench, "TARGET_LENGTHS", (16, 32))
    monkeypatch.setattr(bench, "matmul_peak", lambda **kwargs: 1e11)  # not under test here
    args = ["--variants", "syn_random", "xbox", "linear", "--no-memory", "--no-baselines"]
    out = bench.run(bench.parse([*TINY, *args, "--threads", "1"]))
    missed = {c["target"].split(" at ")[0]: c for c in out["targets"] if not c["met"]}
    assert set(missed) == {"syn_random", "xbox", "linear"}
    syn = out["variants"]["syn_random"]["other_kernel"][32]
    used = out["variants"]["syn_random"]["kernel"][32].rstrip("*")
    assert syn["kernel"] == {"short": "long", "long": "short"}[used] and syn["ms"] > 0
    assert f"the {syn['kernel']} kernel takes" in missed["syn_random"]["why"]
    assert "neither kernel meets the limit" in missed["syn_random"]["why"]
    assert "(selection overhead)" in missed["xbox"]["why"]
    assert missed["linear"]["why"] == "one kernel only"
    bench.print_table(out)
    assert "      why: one kernel only" in capsys.readouterr().out


def test_lsh_recall_is_one_when_every_other_key_is_kept_and_above_chance_otherwise():
    from speechattn.bench.lsh_recall import recall

    assert recall("xbox", "l2", T=20, k=19, bits=8, batch=1, raw=False) == 1.0
    assert recall("simple_lsh", "sign", T=200, k=16, bits=16, batch=1, raw=False) > 2 * 16 / 199


def test_kernels_counted_per_step_are_the_operator_calls_made_from_python_or_autograd():
    import torch

    from speechattn.bench.common import count_kernels

    a = torch.randn(8, 8)
    assert count_kernels(lambda: (a @ a) @ a, "cpu") == 2  # matmul's own mm is part of it
    assert count_kernels(lambda: [a @ a for _ in range(5)], "cpu") == 5
    w = torch.randn(8, 8, requires_grad=True)
    backward = count_kernels(lambda: (a @ w).sum().backward(), "cpu")
    assert backward > 2  # the backward's calls, made by autograd, count too

"""The GPU lease command (`scripts/gpu_measurements.sh lease`, `speechattn.bench.lease`), run on
the CPU with a tiny model: the harness itself, its crash recovery and its deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speechattn.attention import available, registry
from speechattn.bench import lease

ROOT = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `scripts/gpu_measurements.sh lease ARGS` with $OUT = tmp_path/out."""
    environment = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "SPEECHATTN_CACHE": str(tmp_path / "cache"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # this venv's python3
        **(env or {}),
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_measurements.sh"), "lease", *args],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _lines(tmp_path: Path) -> list[dict]:
    return [
        json.loads(line) for line in (tmp_path / "out" / "lease.jsonl").read_text().splitlines()
    ]


def _final(lines: list[dict]) -> dict[str, dict]:
    """The last line of each case (a "started" line is followed by its result)."""
    return {e["case"]: e for e in lines if "case" in e}


@pytest.mark.slow
def test_cpu_dry_run_writes_a_line_per_variant_and_a_summary(tmp_path):
    code, out = _script(tmp_path, "--device", "cpu", "--tiny")
    assert code == 0, out[-3000:]
    lines = _lines(tmp_path)
    cases = _final(lines)
    assert cases["machine"]["peak_tflops"] > 0 and cases["machine"]["torch"]
    for name in available():
        entry = cases[name]
        assert entry["status"] == "ok", (name, entry.get("error"))
        assert entry["finite"] and entry["ms"] > 0 and 0 < entry["mfu"] < 1, entry
        assert entry["frames"] % 64 == 0  # padded to the length bucket as training pads
        assert entry["reads"] >= 1  # the step's one check is always read
        assert entry["vs_full"] == pytest.approx(entry["ms"] / cases["full"]["ms"])
    flex = [n for n in available() if "kernel" in registry.options(n)]
    assert flex and all(cases[f"{n}:flex"]["status"] == "ok" for n in flex)
    assert not any(c.endswith(":compiled") for c in cases)  # none by default on a CPU
    light = cases["full:lightning"]
    assert light["status"] == "ok" and light["steps"] == 30 and light["frames_per_s"] > 0
    assert lines[-1]["summary"] and lines[-1]["n_ok"] == len(available()) + len(flex) + 1
    table = (tmp_path / "out" / "lease.md").read_text()
    assert "| full | ok |" in table and "Lightning, full, 30 steps" in table
    assert list(cases) == ["machine", *lease_order()]  # full first, Flex and Lightning last


def lease_order() -> list[str]:
    args = lease.parse(["--device", "cpu", "--tiny"])
    return [case for case, *_ in lease.cases(args)]


@pytest.mark.slow
def test_a_failing_case_and_a_crash_keep_every_other_line(tmp_path):
    """A case that raises is recorded with its error and the next one runs; a case that kills
    the process is recorded as crashed by the script's rerun, which skips the finished ones."""
    code, out = _script(
        tmp_path, "--device", "cpu", "--tiny", "--variants", "full,xbox,ldsa,linear",
        "--flex", "none", "--lightning-steps", "0", "--inject-crash", "xbox",
        "--inject-failure", "ldsa",
    )  # fmt: skip
    assert code == 0, out[-3000:]
    assert "the lease run stopped (attempt 1); resuming" in out
    lines = _lines(tmp_path)
    cases = _final(lines)
    assert cases["full"]["status"] == "ok" and cases["linear"]["status"] == "ok"
    assert cases["xbox"]["status"] == "crashed"
    assert cases["ldsa"]["status"] == "failed" and "--inject-failure ldsa" in cases["ldsa"]["error"]
    assert sum(e.get("case") == "full" and e.get("status") == "ok" for e in lines) == 1  # not rerun
    assert lines[-1]["summary"] and lines[-1]["n_crashed"] == lines[-1]["n_failed"] == 1


def test_no_case_starts_that_would_end_past_the_deadline(tmp_path, monkeypatch):
    """After a case of a kind took S seconds, no case of that kind starts less than S before
    the deadline; skipped cases are written as such, and the summary still ends the file."""
    clock = [1000.0]
    monkeypatch.setattr(lease.time, "time", lambda: clock[0])
    monkeypatch.setenv("SPEECHATTN_LEASE_T0", "1000")
    monkeypatch.setattr(lease, "machine", lambda args: {"device": "test", "peak_tflops": 1.0})

    def fake_case(args, name, extra, compiled, peak):
        clock[0] += 40.0  # every step case takes 40 s
        return {"ms": 1.0, "finite": True}

    monkeypatch.setattr(lease, "run_step_case", fake_case)
    args = lease.parse(["--device", "cpu", "--tiny", "--variants", "full,ldsa,xbox,linear",
                        "--flex", "none", "--lightning-steps", "0", "--deadline", "100",
                        "--out", str(tmp_path / "out")])  # fmt: skip
    lease.run(args)
    cases = _final(_lines(tmp_path))
    # full ends at 40 s, ldsa at 80 s; xbox would end at 120 s > 100 s: skipped, linear too
    assert [cases[n]["status"] for n in ("full", "ldsa", "xbox", "linear")] == [
        "ok", "ok", "skipped", "skipped"
    ]  # fmt: skip
    assert "deadline" in cases["xbox"]["error"]
    assert _lines(tmp_path)[-1]["summary"]


def test_missing_wheels_fail_loudly(tmp_path):
    """On a machine without the project's dependencies and without carried wheels the script
    stops at once and says what to do."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").write_text("#!/bin/sh\nexit 1\n")  # a python3 that imports nothing
    (bare / "python3").chmod(0o755)
    env = {"PATH": f"{bare}:/usr/bin:/bin"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_measurements.sh"), "lease"],
        cwd=tmp_path, env={**env, "OUT": str(tmp_path / "out")}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1
    assert "no wheels were carried" in done.stderr and "device_wheels.sh" in done.stderr


def test_attention_backend_names_the_fused_kernel():
    names = ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x"]
    assert lease.attention_backend(names) == "cudnn"
    assert lease.attention_backend(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) == "efficient"
    assert lease.attention_backend(["triton_tem_fused_flex_attention_0"]) == "flex"
    assert lease.attention_backend(["ampere_sgemm_128x64_tn", "softmax_warp_forward"]) == "none"

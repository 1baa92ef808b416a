"""`python -m speechattn.bench pretrain --plan`: FLOPs of a training step and what they project
to on a GPU, from the composed pretraining config, without timing anything."""

from __future__ import annotations

import json

import pytest
import torch

from speechattn.bench import pretrain as bench
from speechattn.model.aalbert import ModelConfig
from speechattn.model.masking import MaskingConfig


def _plan(*argv: str) -> dict:
    return bench.plan(bench.parse(["--attention", "full,ldsa", *argv]))


def test_plan_projects_step_time_gpu_hours_and_loader_rate(tmp_path, capsys):
    path = tmp_path / "plan.json"
    result = _plan("--plan", "experiment=paper", "--json", str(path))
    assert json.loads(path.read_text()) == result
    assert (result["batch"], result["frames"], result["crop"]) == (50, 500, 1500)
    assert (result["steps"], result["dtype"], result["mfu"]) == (500_000, "bf16", 0.4)
    rows = {r["attention"]: r for r in result["rows"]}
    assert rows["ldsa"]["step_tflop"] < rows["full"]["step_tflop"]  # 15-frame window < 500
    for r in rows.values():
        step_s = r["step_ms"] / 1e3
        assert r["step_tflop"] > 0
        assert step_s == pytest.approx(r["step_tflop"] * 1e12 / (0.4 * 989.4e12))
        assert r["gpu_hours"] == pytest.approx(500_000 * step_s / 3600)
        assert r["frames_per_step"] == 50 * 1500
        assert r["loader_frames_per_s"] == pytest.approx(r["frames_per_step"] / step_s)
    # full at B 50 x T' 500: about 7.2 TFLOP, 18 ms at 40 % of an H100
    assert 7.0 < rows["full"]["step_tflop"] < 7.4 and 17 < rows["full"]["step_ms"] < 19
    assert "PROJECTION, not a measurement" in capsys.readouterr().out

    a100 = _plan("--plan", "experiment=paper", "--gpu", "a100", "--mfu", "0.5")
    for mine, theirs in zip(result["rows"], a100["rows"], strict=True):
        assert theirs["step_tflop"] == mine["step_tflop"]
        assert theirs["step_ms"] == pytest.approx(mine["step_ms"] * 989.4 / 312 * 0.4 / 0.5)


def test_plan_reads_the_overrides():
    """Batch, crop, steps and precision come from the config the overrides compose."""
    result = _plan(
        "--plan", "experiment=paper", "data.batch_size=10", "data.max_frames=300",
        "trainer.max_steps=-1", "trainer.precision=32-true",
    )  # fmt: skip
    assert (result["batch"], result["frames"], result["dtype"]) == (10, 100, "tf32")
    assert all(r["gpu_hours"] is None for r in result["rows"])  # no step limit
    with pytest.raises(SystemExit, match="mfu"):
        _plan("--plan", "--mfu", "0")


CONV = {"conv_position_kernel": 5, "conv_position_groups": 4}  # aalbert_tiny's positions


@pytest.mark.parametrize("extra", [{}, {"pre_norm": True, **CONV}], ids=["base", "tiny"])
def test_step_flops_equal_the_counted_step_of_full(extra):
    """`step_flops` (model products + `Attention.flops`) equals torch's FLOP counter (with the
    bench's corrections) over a real training step of `full`, forward + backward, small."""
    config = ModelConfig(dim=32, num_layers=2, num_heads=4, ffn_dim=64, **extra)
    B, T = 2, 16
    model = bench.build("full", config, T, "cpu")
    batch = {"features": torch.randn(B, 3 * T, 80), "lengths": torch.full((B,), 3 * T), "stack": 3}
    counted = bench.count_flops(bench.make_step(model, batch, MaskingConfig()))
    assert bench.step_flops(config, B, T) == counted


def test_grouped_convolution_positions_count_three_forwards():
    """The convolutional positions' backward is twice their forward (torch 2.11's own counter
    gives a grouped convolution's input gradient `groups` times its products)."""
    base = ModelConfig(dim=32, num_layers=1, num_heads=4, ffn_dim=64)
    conv = ModelConfig(**{**base.to_dict(), **CONV})
    forward = 2 * 16 * 32 * (32 // 4) * 5  # T' 16, D 32, 8 inputs per channel, 5 taps
    assert bench.model_flops(conv, 16) - bench.model_flops(base, 16) == 3 * forward

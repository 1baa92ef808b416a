"""GPU suite (`pytest -m gpu`; skipped without CUDA): the study's model trains on the device.

- a 30-step aalbert_base (`~experiment`) bf16-mixed pretraining per attention family, loss decreasing;
- an interrupted run resumed from `last.ckpt` on the device equals an uninterrupted one;
- `trainer=ddp` over every visible GPU;
- `bench attention --device cuda` and `bench pretrain --device cuda` report MFU against the
  GPU's measured bf16 matmul peak.

The data is the synthetic DataModule of conftest.py (80 smooth "log-mel" bins).
"""

from __future__ import annotations

import statistics

import pytest
import torch
from conftest import SyntheticPretrainData, compose_pretrain
from test_pretrain_cli import cli, finish

import speechattn
from speechattn.pretrain import run
from speechattn.tasks.common import read_metrics
from speechattn.tasks.pretrain import PretrainTask

pytestmark = pytest.mark.gpu
FAMILIES = ["full", "sparse_strided", "xbox", "syn_random", "syn_dense", "ldsa"]


def _trainer(device: torch.device, precision: str = "bf16-mixed") -> list[str]:
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    return [
        f"trainer.accelerator={accelerator}",
        "trainer.devices=1",
        f"trainer.precision={precision}",
    ]


def _quiet(*overrides: str) -> list[str]:
    return ["progress_bar=none", "logger=none", "trainer.enable_model_summary=false", *overrides]


@pytest.mark.parametrize("attention", FAMILIES)
def test_aalbert_base_bf16_pretraining_loss_decreases(attention, gpu_device, tmp_path):
    steps = 30
    cfg = compose_pretrain(
        tmp_path,
        "~data",
        "~experiment",  # aalbert_base as the study has it
        f"attention={attention}",
        *_trainer(gpu_device),
        *_quiet(f"trainer.max_steps={steps}", "trainer.val_check_interval=30"),
        "trainer.log_every_n_steps=1",
        "checkpoint.every_n_steps=30",
        shrink=False,
    )
    result = run(cfg, SyntheticPretrainData(feature_dim=80))
    losses = [r["train_loss"] for r in read_metrics(tmp_path / "metrics.csv")]
    losses = [v for v in losses if v == v]  # rows without a train loss hold NaN
    assert len(losses) >= steps - 1 and all(torch.isfinite(torch.tensor(losses)))
    # 30 steps include the base model's LR warm-up: a few percent (4 % for full in fp32 on CPU)
    assert statistics.fmean(losses[-5:]) < 0.98 * statistics.fmean(losses[:5]), losses
    up = speechattn.load_upstream(result["upstream"])
    assert up.metadata["steps"] == steps


def test_resume_on_gpu_equals_uninterrupted_run(gpu_device, tmp_path, monkeypatch):
    common = ["~data", *_trainer(gpu_device, "32-true"), "model.net.dropout=0.1"]
    reference = run(compose_pretrain(tmp_path / "reference", *common), SyntheticPretrainData())

    original = PretrainTask.training_step

    def crash_at_step_5(self, batch, batch_idx):
        if self.global_step == 5:
            raise RuntimeError("simulated crash")
        return original(self, batch, batch_idx)

    crashed = tmp_path / "crashed"
    monkeypatch.setattr(PretrainTask, "training_step", crash_at_step_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(compose_pretrain(crashed, *common), SyntheticPretrainData())
    monkeypatch.setattr(PretrainTask, "training_step", original)
    resumed = run(compose_pretrain(crashed, *common, "ckpt_path=last"), SyntheticPretrainData())
    assert resumed["steps"] == reference["steps"] == 8  # compose_pretrain's step count
    got = torch.load(resumed["upstream"], weights_only=True)["state_dict"]
    want = torch.load(reference["upstream"], weights_only=True)["state_dict"]
    for k, v in want.items():  # GPU reductions are not bitwise deterministic
        torch.testing.assert_close(got[k], v, atol=1e-4, rtol=1e-3, msg=k)


def test_ddp_over_all_visible_gpus(gpu_device, tmp_path):
    if gpu_device.type != "cuda":
        pytest.skip("CPU DDP is covered by test_pretrain_cli.py")
    out = finish(
        cli(tmp_path, "trainer=ddp", "trainer.devices=-1", "trainer.max_steps=6",
            "trainer.val_check_interval=3", "trainer.log_every_n_steps=3")
    )  # fmt: skip
    up = speechattn.load_upstream(tmp_path / "upstream.pt")
    assert up.metadata["world_size"] == torch.cuda.device_count(), out[-2000:]
    assert up.metadata["steps"] == 6


def test_benchmarks_report_mfu_on_the_device(gpu_device, tmp_path):
    from speechattn.bench import attention, pretrain

    device = gpu_device.type
    out = attention.main(
        ["--device", device, "--lengths", "256", "1024", "--dim", "256", "--heads", "4",
         "--reps", "1", "--variants", "ldsa", "xbox", "--no-memory"]
    )  # fmt: skip
    want = "bf16" if device == "cuda" else "fp32"
    assert out["meta"]["precision"] == want and out["meta"]["matmul_peak_gflops"] > 0
    for name in ("full", "ldsa", "xbox"):
        assert all(0 < m <= 1 for m in out["variants"][name]["mfu"].values()), name
    result = pretrain.run(
        pretrain.parse(
            ["--device", device, "--model", "aalbert_tiny", "--batch", "2", "--frames", "64",
             "--attention", "full,ldsa", "--repeat", "1", "--warmup", "1"]
        )
    )  # fmt: skip
    assert result["precision"] == want and result["peak_gflops"] > 0
    assert all(0 < r["of_peak"] <= 1 for r in result["rows"]), result["rows"]

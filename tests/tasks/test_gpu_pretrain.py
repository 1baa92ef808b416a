"""GPU suite (`pytest -m gpu`; skipped without CUDA): the study's model trains on the device.

- a 30-step aalbert_base (`~experiment`) bf16-mixed pretraining per attention family, loss decreasing;
- every variant (all 19; both kernels of the two-kernel ones, forced past their crossover; the
  FlexAttention kernel where a variant has one) trains a few bf16 steps at the paper's shapes,
  aalbert_base with batches of 50 x 500 model frames (1500 10 ms frames), with the host syncs of
  one step counted (`speechattn.bench.syncs.SyncCounter`: at most one read, no blocking upload
  on CUDA) and another step profiled (kernel launches, CUDA runtime syncs and copies);
  `SPEECHATTN_GPU_RESULTS=DIR` also writes the counts to DIR/paper_steps.jsonl,
  `SPEECHATTN_GPU_VARIANTS=full,ldsa` narrows the variants;
- the same steps compiled (`model.compile=true`) for every variant;
- the built-in corpus's loader with worker processes (`data.num_workers=2`, pinned memory);
- an interrupted run resumed from `last.ckpt` on the device equals an uninterrupted one, in
  fp32 and in bf16-mixed;
- `trainer=ddp` over every visible GPU;
- the matmul peak (`bench.common.matmul_series`) is sustained and below the vendor's figure;
- `bench attention --device cuda` and `bench pretrain --device cuda` report MFU against the
  GPU's measured bf16 matmul peak.

The data is the synthetic DataModule of _pretrain_testing.py (80 smooth "log-mel" bins).
`SPEECHATTN_GPU_SUITE_DEVICE=cpu` runs the suite on CPU to check the tests themselves: the
paper-shape steps then shrink to a 2-layer D 64 model and batches of 2 x 100 frames.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
from typing import Any

import lightning as L
import pytest
import torch
from _pretrain_testing import SyntheticPretrainData, SyntheticSpeech, compose_pretrain
from omegaconf import DictConfig, open_dict
from test_pretrain_cli import cli, finish
from test_step_syncs import CountSteps
from torch.utils.data import ConcatDataset, Dataset

import speechattn
from speechattn.attention import available, get, registry
from speechattn.bench.common import CUDA_LAUNCHES  # the profiler's CUDA calls
from speechattn.bench.lease import RUNTIME_SYNCS
from speechattn.pretrain import run
from speechattn.tasks.common import read_metrics
from speechattn.tasks.pretrain import PretrainTask

pytestmark = pytest.mark.gpu
FAMILIES = ["full", "sparse_strided", "xbox", "syn_random", "syn_dense", "ldsa"]
VARIANTS = [n for n in os.environ.get("SPEECHATTN_GPU_VARIANTS", "").split(",") if n] or available()


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


# GPU reductions are not bitwise deterministic; bf16 products round those differences coarser
RESUME_TOLERANCE = {"32-true": (1e-4, 1e-3), "bf16-mixed": (2e-3, 2e-2)}  # atol, rtol


@pytest.mark.parametrize("precision", sorted(RESUME_TOLERANCE))
def test_resume_on_gpu_equals_uninterrupted_run(precision, gpu_device, tmp_path, monkeypatch):
    common = ["~data", *_trainer(gpu_device, precision), "model.net.dropout=0.1"]
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
    atol, rtol = RESUME_TOLERANCE[precision]
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=atol, rtol=rtol, msg=k)


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


# ----------------------------------------------------------------------------- paper shapes


def _paper_cases() -> list[tuple[str, str]]:
    """(variant, kernel) for every variant: "rule" (its crossover decides), or "short" and
    "long" forced for the two-kernel variants, and "flex" where the variant has that kernel."""
    cases = []
    for name in VARIANTS:
        two = get(name).short_path_max_t is not None
        cases += [(name, "short"), (name, "long")] if two else [(name, "rule")]
        if "kernel" in registry.options(name):
            cases.append((name, "flex"))
    return cases


def _paper_shape(device: torch.device) -> tuple[list[str], int, int]:
    """(model overrides, batch, utterance frames): the paper's on CUDA, small on CPU."""
    if device.type == "cuda":
        return [], 50, 1500  # aalbert_base, 50 x 500 model frames
    small = ["model.net.dim=64", "model.net.num_layers=2", "model.net.num_heads=4"]
    return [*small, "model.net.ffn_dim=128"], 2, 300


@functools.cache
def _paper_utterances(batch: int, frames: int, steps: int) -> tuple[Dataset, Dataset]:
    """(train, val): utterances of 2/3 to all of `frames`, one in five at the full crop, so
    batches are padded and reach the crop, as LibriSpeech's crops do (built once per shape)."""
    full = SyntheticSpeech(batch * steps // 4 + 1, 80, seed=2, min_len=frames, max_len=frames)
    shorter = SyntheticSpeech(batch * steps, 80, seed=0, min_len=2 * frames // 3, max_len=frames)
    val = SyntheticSpeech(batch, 80, seed=1, min_len=2 * frames // 3, max_len=frames)
    return ConcatDataset([full, shorter]), val


def _paper_data(batch: int, frames: int, steps: int) -> SyntheticPretrainData:
    data = SyntheticPretrainData(n_train=0, n_val=0, feature_dim=80, batch_size=batch)
    data.train, data.val = _paper_utterances(batch, frames, steps)
    return data


def _force_kernel(cfg: DictConfig, name: str, kernel: str, monkeypatch) -> None:
    """Run `kernel` whatever T is: the crossover moved past T (autotune off), or Flex."""
    with open_dict(cfg):
        cfg.attention.autotune = False  # the rule (short_path_max_t), not a timing
        if kernel == "flex":
            cfg.attention.options.kernel = "flex"
            cfg.model.net.attention_options.kernel = "flex"
            torch._dynamo.reset()  # Flex failed after other tests' Flex compiles (docs/gpu.md)
    if kernel in ("short", "long"):
        limit = 10**9 if kernel == "short" else 0
        monkeypatch.setattr(get(name), "short_path_max_t", limit)


class MeasureStep(CountSteps):
    """Counts the host syncs of training step 1 whole (`CountSteps`: reads and blocking
    uploads, with where each comes from, up to the end of Lightning's own work on the batch)
    and profiles step 2 (kernel launches, CUDA runtime syncs and copies; aten ops on CPU)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(only=1, cpu_is_device=device.type == "cpu")
        self.device = device
        self.counts: dict[str, Any] = {}
        self._profiler = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if batch_idx == 2:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 2:
            self._profiler.__exit__(None, None, None)
            names = [e.name for e in self._profiler.events()]
            self.counts["launches"] = sum(n in CUDA_LAUNCHES for n in names)
            self.counts["runtime_syncs"] = sum(n in RUNTIME_SYNCS for n in names)
            self.counts["copies"] = sum(n.startswith("cudaMemcpy") for n in names)
            self.counts["aten_ops"] = sum(n.startswith("aten::") for n in names)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if self.steps:
            counter = self.steps[0]
            self.counts.update(
                syncs=counter.count, sync_reasons=dict(counter.reasons),
                uploads=counter.upload_count, upload_reasons=dict(counter.uploads),
                sync_where=dict(counter.where),
            )  # fmt: skip


def _paper_run(cfg: DictConfig, data, device: torch.device, monkeypatch) -> dict[str, Any]:
    """`run(cfg, data)` with `MeasureStep` added to the trainer; returns its counts."""
    run_module = sys.modules["speechattn.tasks.pretrain.run"]  # the package's `run` is a function
    measure = MeasureStep(device)
    build_trainer = run_module.build_trainer

    def with_measure(*args: Any, **kwargs: Any) -> L.Trainer:
        trainer = build_trainer(*args, **kwargs)
        trainer.callbacks.append(measure)
        return trainer

    monkeypatch.setattr(run_module, "build_trainer", with_measure)
    result = run(cfg, data)
    return {**measure.counts, "steps": result["steps"]}


def _record(entry: dict[str, Any]) -> None:
    """Print the counts; append them to $SPEECHATTN_GPU_RESULTS/paper_steps.jsonl if set."""
    print(json.dumps(entry))
    folder = os.environ.get("SPEECHATTN_GPU_RESULTS")
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "paper_steps.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")


def _paper_config(tmp_path, device: torch.device, name: str, steps: int, *extra: str):
    model, batch, frames = _paper_shape(device)
    cfg = compose_pretrain(
        tmp_path, "~data", "~experiment", f"attention={name}", *model, *_trainer(device),
        *_quiet(f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"),
        "trainer.log_every_n_steps=50",  # the measured steps are not logging steps
        "checkpoint.every_n_steps=1000", "validate_at_start=false", *extra, shrink=False,
    )  # fmt: skip
    return cfg, _paper_data(batch, frames, steps)


@pytest.mark.parametrize(("name", "kernel"), _paper_cases())
def test_every_variant_trains_at_paper_shapes(name, kernel, gpu_device, tmp_path, monkeypatch):
    """A few bf16 steps of aalbert_base on 50 x 1500-frame batches, syncs and launches counted."""
    if kernel == "flex" and gpu_device.type != "cuda":
        pytest.skip("FlexAttention trains on CUDA only (no Flex backward on CPU)")
    steps = 4
    cfg, data = _paper_config(tmp_path, gpu_device, name, steps)
    _force_kernel(cfg, name, kernel, monkeypatch)
    counts = _paper_run(cfg, data, gpu_device, monkeypatch)
    _record({"attention": name, "kernel": kernel, "device": str(gpu_device), **counts})
    assert counts["steps"] == steps
    losses = [r["train_loss"] for r in read_metrics(tmp_path / "metrics.csv")]
    assert all(v == v and abs(v) < float("inf") for v in losses if v == v), losses
    assert counts["aten_ops"] > 0 and counts["syncs"] >= 0
    if gpu_device.type == "cuda":
        assert counts["launches"] > 0, counts
        # docs/gpu.md: check_step's one read, no blocking upload, Lightning's work included
        assert counts["syncs"] <= 1 and counts["uploads"] == 0, counts["sync_where"]


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_trains_compiled(name, gpu_device, tmp_path, monkeypatch):
    """The paper-shape steps with `model.compile=true` (inductor), syncs and launches counted."""
    steps = 4
    cfg, data = _paper_config(tmp_path, gpu_device, name, steps)
    if "compile" not in cfg.model:
        pytest.skip("this tree has no model.compile")
    cfg.model.compile = True
    counts = _paper_run(cfg, data, gpu_device, monkeypatch)
    _record({"attention": name, "kernel": "compiled", "device": str(gpu_device), **counts})
    assert counts["steps"] == steps


def test_pretraining_with_loader_workers(gpu_device, tiny_corpus, tiny_feature_cache, tmp_path):
    """The built-in corpus's loader in worker processes (pinned memory where configurable)."""
    cfg = compose_pretrain(
        tmp_path, f"data.root={tiny_corpus}", f"data.cache_dir={tiny_feature_cache}",
        "data.num_workers=2", "data.extract_workers=1", "data.shard_size=8",
        "data.progress=false", "data.batch_size=4", *_trainer(gpu_device),
        "trainer.max_steps=6", "trainer.val_check_interval=3",
    )  # fmt: skip
    if "pin_memory" in cfg.data:
        cfg.data.pin_memory = True
    result = run(cfg)
    assert result["steps"] == 6
    losses = [r["train_loss"] for r in read_metrics(tmp_path / "metrics.csv")]
    assert any(v == v for v in losses) and all(abs(v) < float("inf") for v in losses if v == v)


def test_matmul_peak_is_sustained_and_below_the_vendor_figure(gpu_device):
    """The MFU denominator: the best sustained rate over series of products of several sizes
    is at least one product's rate and, on a GPU the plan knows, under its vendor peak."""
    from speechattn.bench.common import PRECISIONS, device_name, matmul_series
    from speechattn.bench.pretrain import GPU_PEAKS

    device = gpu_device.type
    dtype = PRECISIONS["bf16" if device == "cuda" else "fp32"]
    rates = matmul_series(device=device, dtype=dtype)
    single = matmul_series(sizes=[max(rates)], seconds=0.0, repeat=1, device=device, dtype=dtype)
    print(device_name(device), {n: f"{r / 1e9:.0f} GFLOP/s" for n, r in rates.items()})
    assert max(rates.values()) >= 0.9 * max(single.values())  # one product: noisy, and slower
    name = device_name(device)
    for gpu, (label, peaks) in GPU_PEAKS.items():
        if gpu.upper() in name.upper():  # e.g. "NVIDIA H100 80GB HBM3"
            assert max(rates.values()) < 1.05 * peaks["bf16"], (label, rates)

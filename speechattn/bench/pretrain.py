"""Benchmark one pretraining step per attention variant, against a plain reference transformer
(docs/benchmarks.md, "Pretraining step", "GPU cost on paper", "torch.compile").

Every variant's step is timed round-robin beside `reference` (a hand-written BERT-style
AALBERT: explicit softmax(QK^T)V, no SDPA, no registry: what the plumbing costs). FLOPs:
`full`'s step by `torch.utils.flop_counter` (with `SDPA_CPU`'s corrections), `full`'s attention
FLOPs replaced by the variant's own (`Attention.flops`).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F_
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from speechattn.attention import build as build_attention
from speechattn.attention.base import linear_flops
from speechattn.bench.common import (
    add_run_arguments,
    attention_names,
    autocast,
    check_mfu,
    clock_of,
    finish_run_arguments,
    matmul_peak,
    parser,
    peak_dtype,
    round_robin,
    setting,
    sized_options,
    time_call,
    write_json,
)
from speechattn.bench.syncs import pretrain_step_syncs
from speechattn.errors import UsageExit
from speechattn.model.aalbert import (
    AALBERT,
    PRESETS,
    ModelConfig,
    padding_mask_for,
    preset_config,
    registry_attention,
    sinusoidal_positions,
)
from speechattn.model.masking import MaskedBatch, MaskingConfig, mask_batch, reconstruction_loss
from speechattn.model.optim import OptimConfig, build_optimizer
from speechattn.tasks.pretrain.compiled import compile_objective, graph_breaks
from speechattn.utils import crop_lengths, lengths_to_padding_mask

FEATURE_DIM = 80


class ReferenceLayer(nn.Module):
    """BERT layer written out by hand: explicit attention matrix, post-LN, GELU FFN."""

    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        """x (B, T, D), pad (B, T) True at padding -> (B, T, D)."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // self.heads)  # (B, h, T, T)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        x = self.norm1(x + self.out(a))
        return self.norm2(x + self.fc2(F_.gelu(self.fc1(x))))


class ReferenceAALBERT(nn.Module):
    """Embedding, one shared ReferenceLayer applied L times, reconstruction head."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.proj = nn.Linear(c.input_dim, c.dim)
        self.norm = nn.LayerNorm(c.dim)
        n = 1 if c.shared else c.num_layers
        self.layers = nn.ModuleList(
            [ReferenceLayer(c.dim, c.num_heads, c.ffn_dim) for _ in range(n)]
        )
        self.head = nn.Sequential(
            nn.Linear(c.dim, c.dim), nn.GELU(), nn.LayerNorm(c.dim), nn.Linear(c.dim, c.input_dim)
        )

    def reconstruct(self, x: Tensor, lengths: Tensor, head_mask: None = None) -> Tensor:
        """x (B, T', 3F) corrupted, lengths' (B,) -> reconstruction (B, T', 3F)."""
        B, T, _ = x.shape
        pad = lengths_to_padding_mask(lengths.to(x.device), T)  # lengths stay on the host
        h = self.norm(self.proj(x) + sinusoidal_positions(T, self.c.dim, x.device, x.dtype))
        for depth in range(self.c.num_layers):
            h = self.layers[depth % len(self.layers)](h, pad)
        return self.head(h)


def _sdpa_cpu_flops(q, k, *args, **kwargs) -> int:
    """Forward of SDPA on shapes q (B, h, T, d_k), k (B, h, S, d_k): 4 B h T S d_k."""
    B, h, T, d = q
    return 4 * B * h * T * k[2] * d


def _conv_backward_flops(
    grad_out,
    x,
    w,
    _bias,
    _stride,
    _padding,
    _dilation,
    transposed,
    _output_padding,
    _groups,
    output_mask,
    **kwargs,
) -> int:
    """A convolution's input and weight gradients, each as many products as its forward
    (torch 2.11's counter takes a grouped convolution's input gradient as `groups` times that:
    aalbert_tiny's convolutional positions)."""
    spatial = x[2:] if transposed else grad_out[2:]
    forward = 2 * grad_out[0] * math.prod(w) * math.prod(spatial)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


SDPA_CPU = {  # the counter's additions and corrections
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad_out, q, k, *args, **kwargs: 2 * _sdpa_cpu_flops(q, k)
    ),
    torch.ops.aten.convolution_backward: _conv_backward_flops,
}


def make_step(
    model: nn.Module,
    batch: dict[str, Tensor],
    masking: MaskingConfig,
    precision: str = "fp32",
    objective: Callable[[MaskedBatch], Tensor] | None = None,
) -> Callable[[], float]:
    """A closure doing one training step, returning the loss. `objective` scores a masked
    batch: `reconstruction_loss` by default, or what `model.compile=true` compiles."""
    opt = build_optimizer(model, OptimConfig(lr=1e-3))  # LAMB with pretraining's decay groups
    g = torch.Generator().manual_seed(0)
    features, lengths = batch["features"], batch["lengths"]
    stack, pad = batch["stack"], batch.get("pad_to_multiple", 1)
    device = features.device.type
    loss_of = objective or (lambda masked: reconstruction_loss(model, masked))

    def step() -> float:
        masked = mask_batch(features, lengths, stack, masking, g, pad)
        with autocast(device, precision):
            loss = loss_of(masked)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def bench_batch(args: argparse.Namespace, config: ModelConfig) -> dict[str, Any]:
    """The timed batch: `--lengths training` draws crops as the loader does and pads to
    `--pad-to-multiple` model frames, so it takes the masked kernels training takes; `--lengths
    full` has every utterance at `--frames` (no padding, no masks). Lengths stay on the host."""
    T, generator = args.frames * config.stack, torch.Generator().manual_seed(0)
    if args.lengths == "full":
        features = torch.randn(args.batch, T, FEATURE_DIM, generator=generator)
        lengths, pad = torch.full((args.batch,), T, dtype=torch.long), 1
    else:
        (features, lengths), pad = crop_batch(args.batch, T, generator), args.pad_to_multiple
    return {
        "features": features.to(args.device),
        "lengths": lengths,
        "stack": config.stack,
        "pad_to_multiple": pad,
    }


def crop_batch(batch: int, crop: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random features (batch, crop, 80), zero past lengths (batch,) cropped as the loader does."""
    lengths = crop_lengths(batch, crop, generator)
    features = torch.randn(batch, crop, FEATURE_DIM, generator=generator)
    features *= (torch.arange(crop)[None, :] < lengths[:, None])[..., None]
    return features, lengths


def count_flops(step: Callable[[], float]) -> int:
    with FlopCounterMode(display=False, custom_mapping=SDPA_CPU) as counter:
        step()
    return int(counter.get_total_flops())


def attention_flops(name: str, config: ModelConfig, batch: int, frames: int) -> float:
    """Training FLOPs of variant `name`'s attention in one step, every layer application."""
    module = build_attention(name, config.dim, config.num_heads, **sized_options(name, frames))
    return module.flops(frames).training * batch * config.num_layers


def build(name: str, config: ModelConfig, frames: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "reference":
        return ReferenceAALBERT(config).to(device).train()
    c = replace(config, attention=name, attention_options=sized_options(name, frames))
    return AALBERT(c).to(device).train()


# Vendor dense peaks of the tensor cores, FLOP/s (no 2:4 structured sparsity: the datasheets'
# headline figures "with sparsity" halved). NVIDIA H100 SXM5 datasheet: BF16/FP16 1,979 and TF32
# 989 TFLOPS with sparsity; NVIDIA A100 datasheet: BF16/FP16 312 and TF32 156 TFLOPS dense.
GPU_PEAKS: dict[str, tuple[str, dict[str, float]]] = {
    "h100": ("NVIDIA H100 SXM", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12}),
    "a100": ("NVIDIA A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12}),
}


def model_flops(config: ModelConfig, frames: int) -> float:
    """Training FLOPs (forward + backward) of one utterance of `frames` model frames through
    all but the attention modules: input projection, convolutional positions, L feed-forwards
    and the reconstruction head (`Flops`' rules: products only, a backward twice the forward;
    the input projection's backward is its weight gradient alone, the features need none)."""
    T, D, F, S = frames, config.dim, config.ffn_dim, config.input_dim  # S: stacked features
    embedding = 2 * linear_flops(T, S, D)
    if config.conv_position_kernel:  # grouped Conv1d: D / groups inputs per output channel
        per_frame = D * (D // config.conv_position_groups) * config.conv_position_kernel
        embedding += 3 * 2.0 * T * per_frame
    ffn = 3 * config.num_layers * (linear_flops(T, D, F) + linear_flops(T, F, D))
    head = 3 * (linear_flops(T, D, D) + linear_flops(T, D, S))
    return embedding + ffn + head


def step_flops(config: ModelConfig, batch: int, frames: int) -> float:
    """Training FLOPs of one step of `batch` utterances of `frames` model frames (the masked-L1
    loss and the optimiser add elementwise work only)."""
    attention = registry_attention(config)(0).flops(frames).training
    return batch * (model_flops(config, frames) + config.num_layers * attention)


def project_step(cfg: Any, gpu: str, mfu: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(setting, projection) of one training step of the composed pretraining config `cfg`
    on `gpu` (a `GPU_PEAKS` key) at `mfu`: `step_flops` with every utterance at the full crop,
    step ms = FLOPs / (MFU x vendor dense peak), GPU-hours for `trainer.max_steps`, the 10 ms
    frames per step and per second the loader owes."""
    from omegaconf import OmegaConf

    peaks = GPU_PEAKS[gpu][1]
    config = ModelConfig(**OmegaConf.to_container(cfg.model.net, resolve=True))
    crop, batch = int(cfg.data.max_frames), int(cfg.data.batch_size)
    frames, steps = crop // config.stack, int(cfg.trainer.max_steps)
    p = str(cfg.trainer.precision)  # -> its products' dtype on tensor cores (TF32 assumed on)
    dtype = "bf16" if p.startswith("bf16") else "fp16" if p.startswith("16") else "tf32"
    setting = {
        "model": str(cfg.model.name),
        "dim": config.dim,
        "layers": config.num_layers,
        "heads": config.num_heads,
        "batch": batch,
        "frames": frames,
        "crop": crop,
        "steps": steps,
        "precision": p,
        "dtype": dtype,
    }
    flops = step_flops(config, batch, frames)
    step_s = flops / (mfu * peaks[dtype])
    return setting, {
        "step_tflop": flops / 1e12,
        "step_ms": step_s * 1e3,
        "gpu_hours": steps * step_s / 3600 if steps > 0 else None,  # -1: no step limit
        "frames_per_step": batch * crop,
        "loader_frames_per_s": batch * crop / step_s,
    }


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """`--plan OVERRIDES`: `project_step` per variant (upper bounds). Nothing is timed."""
    from speechattn.config import compose

    check_mfu(args.mfu)
    gpu, peaks = GPU_PEAKS[args.gpu]
    rows = []
    for name in attention_names(args.attention):
        cfg = compose("pretrain", [*args.plan, f"attention={name}"])
        s, row = project_step(cfg, args.gpu, args.mfu)  # s: the setting, the same for every row
        rows.append({"attention": name, **row})
    print(
        f"plan for {' '.join(args.plan) or 'the default config'}: {s['model']} (D {s['dim']}, "
        f"{s['layers']} layers, {s['heads']} heads), batch {s['batch']} x {s['frames']} model "
        f"frames ({s['crop']} 10 ms frames), {s['steps']} steps, {s['precision']}\n"
        f"PROJECTION, not a measurement: step time = FLOPs / ({args.mfu:.2f} MFU x {gpu} "
        f"{s['dtype']} dense peak {peaks[s['dtype']] / 1e12:.1f} TFLOP/s, vendor figure)"
    )
    print(
        f"  {'attention':15s} {'TFLOP/step':>10s} {'step ms':>8s} {'GPU-hours':>9s} "
        f"{'loader M frames/s (10 ms)':>26s}"
    )
    for r in rows:
        hours = "n/a" if r["gpu_hours"] is None else f"{r['gpu_hours']:9.1f}"
        print(
            f"  {r['attention']:15s} {r['step_tflop']:10.2f} {r['step_ms']:8.1f} {hours:>9s} "
            f"{r['loader_frames_per_s'] / 1e6:26.2f}"
        )
    result = {
        "benchmark": "pretrain_plan",
        "overrides": list(args.plan),
        "gpu": gpu,
        "peak_tflops": peaks[s["dtype"]] / 1e12,
        "mfu": args.mfu,
        **s,
        "rows": rows,
    }
    write_json(args.json, result)
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser("pretrain", __doc__)
    p.add_argument("--model", default="aalbert_base", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--frames", type=int, default=500, help="stacked 30 ms frames per utterance")
    p.add_argument("--attention", default="all", help="comma-separated names, or all")
    p.add_argument(
        "--lengths",
        default="training",
        choices=("training", "full"),
        help="training: crops of 2/3 to all of --frames, padded as training pads "
        "(default); full: every utterance at --frames, unpadded",
    )
    p.add_argument("--pad-to-multiple", type=int, default=64, help="model frames (training)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    add_run_arguments(p)
    p.add_argument("--dropout", type=float, default=0.0, help="0 keeps the step matmul-bound")
    p.add_argument(
        "--compile",
        action="store_true",
        help="per variant: graph breaks of model.compile's unit, compiled vs eager step",
    )
    p.add_argument(
        "--plan",
        nargs="*",
        default=None,
        metavar="OVERRIDE",
        help="project instead of timing: FLOPs, GPU time and loader rate per "
        "step of the config the overrides compose (e.g. experiment=paper)",
    )
    p.add_argument("--gpu", default="h100", choices=sorted(GPU_PEAKS), help="--plan's GPU")
    p.add_argument("--mfu", type=float, default=0.4, help="--plan's model FLOPs utilisation")
    return finish_run_arguments(p.parse_args(argv))


def setup(args: argparse.Namespace, header: str = "") -> tuple[list[str], ModelConfig, dict]:
    """The variants to run, the model's config and the timed batch, with the run's header."""
    names = attention_names(args.attention)
    config = preset_config(args.model, feature_dim=FEATURE_DIM, dropout=args.dropout)
    batch, s = bench_batch(args, config), setting(args)
    lengths = batch["lengths"] // batch["stack"]
    shaped = (
        f"crops of {int(lengths.min())}-{int(lengths.max())}, padded to multiples of "
        f"{batch['pad_to_multiple']} as training pads"
        if batch["pad_to_multiple"] != 1
        else "all at the crop, unpadded"
    )
    print(
        f"{args.model}, batch {args.batch} x {args.frames} stacked frames ({shaped}), "
        f"{s['device']} ({s['device_name']}), {s['precision']}, {s['threads']} threads" + header
    )
    return names, config, batch


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.clock == "cpu" and (args.device != "cpu" or torch.get_num_threads() != 1):
        raise UsageExit("--clock cpu needs --device cpu --threads 1 (CPU time of one thread)")
    clock, dtype = clock_of(args), peak_dtype(args.precision)
    peak = matmul_peak(device=args.device, dtype=dtype, clock=clock)
    names, config, batch = setup(
        args,
        f", {args.clock} clock; {str(dtype).removeprefix('torch.')}"
        f" matmul peak {peak / 1e9:.1f} GFLOP/s",
    )
    # timed round-robin (`round_robin`); the peak is re-measured at the end
    steps = {}
    for name in ["reference", "full", *[n for n in names if n != "full"]]:
        model = build(name, config, args.frames, args.device)
        steps[name] = make_step(model, batch, MaskingConfig(), precision=args.precision)
        if name == "full":
            counted_full = count_flops(steps[name])
        for _ in range(args.warmup):
            steps[name]()
    if "full" not in names:
        del steps["full"]
    # a variant's step as it is defined: full's counted step with full's attention swapped out
    base = counted_full - attention_flops("full", config, args.batch, args.frames)
    flops = {"reference": count_flops(steps["reference"])}
    for name in [n for n in steps if n != "reference"]:
        flops[name] = base + attention_flops(name, config, args.batch, args.frames)
    times = round_robin(steps, args.repeat, args.device, clock)
    peak = max(peak, matmul_peak(device=args.device, dtype=dtype, clock=clock))
    print(f"  (peak re-measured after the steps: {peak / 1e9:.1f} GFLOP/s, the best is used)")
    rows = []
    for name in steps:
        seconds = statistics.median(times[name])
        reads = uploads = None
        if name != "reference":  # one fp32 `PretrainTask` step's syncs at this batch and length
            opts = sized_options(name, args.frames)
            net = {**config.to_dict(), "attention": name, "attention_options": opts}
            syncs = pretrain_step_syncs(net, args.batch, args.frames, args.device)
            reads, uploads = syncs.count, syncs.upload_count
        rate = flops[name] / seconds
        bound = None if name == "reference" else counted_full / flops[name]
        rows.append(
            r := {
                "attention": name,
                "step_s": seconds,
                "gflop": flops[name] / 1e9,
                "gflops": rate / 1e9,
                "of_peak": rate / peak,
                "flop_bound": bound,
                "syncs_per_step": reads,
                "uploads_per_step": uploads,
            }
        )
        syncs = "" if reads is None else f"  {reads} syncs/step"
        syncs += f", {uploads} uploads/step" if uploads else ""
        print(
            f"  {name:15s} {seconds * 1e3:9.1f} ms  {r['gflop']:8.2f} GFLOP  "
            f"{r['gflops']:7.1f} GFLOP/s  MFU {100 * r['of_peak']:5.1f} %{syncs}"
        )
    if "full" in steps:
        full_s = statistics.median(times["full"])
        print("step time relative to full, speed-up FLOP bound, achieved / bound:")
        for r in rows:
            r["vs_full"] = r["step_s"] / full_s
            line = f"  {r['attention']:15s} {r['vs_full']:.2f}x"
            if r["flop_bound"] is not None:  # the reference counts its own FLOPs
                r["achieved_of_bound"] = share = 1 / r["vs_full"] / r["flop_bound"]
                line += f"  bound {r['flop_bound']:.2f}  achieved/bound {share:.2f}"
            print(line)
    result = {
        "benchmark": "pretrain_step",
        "model": args.model,
        "batch": args.batch,
        "frames": args.frames,
        "lengths": args.lengths,
        **setting(args),
        "clock": args.clock,
        "peak_gflops": peak / 1e9,
        "rows": rows,
    }
    write_json(args.json, result)
    return result


def explain(model: nn.Module, batch: dict[str, Tensor], masking: MaskingConfig, precision: str):
    """Graph breaks of the compile unit on one masked batch -> {graphs, breaks, reasons}."""
    masked = mask_batch(
        batch["features"],
        batch["lengths"],
        batch["stack"],
        masking,
        torch.Generator(),
        batch.get("pad_to_multiple", 1),
    )
    pad = padding_mask_for(masked.lengths, masked.inputs)
    with autocast(batch["features"].device.type, precision):
        return graph_breaks(model, masked.inputs, masked.target, masked.chosen, pad)


def run_compile(args: argparse.Namespace) -> dict[str, Any]:
    """`--compile`, per variant: the graph breaks of what `model.compile=true` compiles, with
    their reasons, the first compiled step's time (compilation included), then the eager and
    the compiled step timed round-robin (medians). The backward has no graph breaks of its own:
    AOTAutograd derives it from the forward graphs."""
    names, config, batch = setup(args)
    masking = MaskingConfig()
    rows = []
    print("graph breaks (torch._dynamo.explain of the compile unit), eager vs compiled step:")
    for name in names:
        fresh = functools.partial(build, name, config, args.frames, args.device)  # seeded
        info = explain(fresh(), batch, masking, args.precision)
        eager = make_step(fresh(), batch, masking, args.precision)
        model = fresh()
        compiled = make_step(model, batch, masking, args.precision, compile_objective(model))
        for _ in range(args.warmup):
            eager()
        first = time_call(compiled, args.device)  # compiles
        for _ in range(max(args.warmup - 1, 0)):
            compiled()
        times = round_robin({"eager": eager, "compiled": compiled}, args.repeat, args.device)
        e, c = (statistics.median(times[k]) for k in ("eager", "compiled"))
        rows.append(
            {
                "attention": name,
                "graphs": info["graphs"],
                "graph_breaks": info["breaks"],
                "break_reasons": info["reasons"],
                "compile_s": first,
                "eager_s": e,
                "compiled_s": c,
                "compiled_vs_eager": c / e,
            }
        )
        print(
            f"  {name:15s} breaks {info['breaks']:3d} ({info['graphs']} graphs)  first compiled "
            f"step {first:7.1f} s  eager {e * 1e3:8.1f} ms  compiled {c * 1e3:8.1f} ms  "
            f"compiled/eager {c / e:.2f}"
        )
        for reason, n in Counter(info["reasons"]).most_common(4):
            print(f"      {n:3d} x {reason}")
        torch._dynamo.reset()  # each variant compiles from scratch, within the recompile limit
    result = {
        "benchmark": "pretrain_compile",
        "model": args.model,
        "batch": args.batch,
        "frames": args.frames,
        **setting(args),
        "torch": torch.__version__,
        "rows": rows,
    }
    write_json(args.json, result)
    return result


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.plan is not None:
        plan(args)
    elif args.compile:
        run_compile(args)
    else:
        run(args)

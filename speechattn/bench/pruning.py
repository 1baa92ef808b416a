"""Speed and memory gained by actual pruning: the head-masked model against the pruned one.

Both run the same inference forward on one batch, interleaved after one warm-up each:
`masked`, the upstream with the head mask (xi = 0 on the pruned heads), and `pruned`, the same
upstream after `AALBERT.prune_heads(mask)` (the same outputs; the largest difference is
printed). The mask is the heads.json pruning point nearest to `--fraction` (`--heads`), else
`random_mask`. Without `--upstream` the model is a `--model` preset with random weights.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from speechattn.bench.common import (
    add_run_arguments,
    autocast,
    finish_run_arguments,
    parser,
    peak_memory,
    round_robin,
    setting,
    sized_options,
    write_json,
)
from speechattn.model.aalbert import AALBERT, PRESETS, preset_config
from speechattn.model.pruning import pruning_point
from speechattn.model.upstream import load_upstream

FEATURE_DIM = 80


def random_mask(model: AALBERT, fraction: float, seed: int = 0) -> Tensor:
    """(L, h) mask with round(fraction h) heads masked per layer object (seeded), the same
    heads at every depth that runs that layer."""
    L, h = model.num_layers, model.num_heads
    g = torch.Generator().manual_seed(seed)
    layers = range(len(model.encoder.layers))
    drop = {j: torch.randperm(h, generator=g)[: round(fraction * h)] for j in layers}
    mask = torch.ones(L, h)
    for depth, j in enumerate(model.encoder.depth_to_layer):
        mask[depth, drop[j]] = 0.0
    return mask


def models(args: argparse.Namespace) -> tuple[AALBERT, AALBERT, Tensor, str]:
    """(full model, pruned model, mask (L, h), where the mask comes from), on `--device`."""
    if args.upstream:
        full = load_upstream(args.upstream).model
    else:
        opts = sized_options(args.attention, args.frames)
        config = preset_config(
            args.model, feature_dim=FEATURE_DIM, attention=args.attention, attention_options=opts
        )
        torch.manual_seed(0)
        full = AALBERT(config)
    if args.heads:
        point = pruning_point(json.loads(Path(args.heads).read_text()), args.fraction)
        mask, source = torch.tensor(point["mask"]), f"{args.heads}, point {point['fraction']:.3f}"
    else:
        mask, source = random_mask(full, args.fraction, args.seed), f"random, seed {args.seed}"
    pruned = copy.deepcopy(full)
    pruned.prune_heads(mask)
    device = torch.device(args.device)
    return full.eval().to(device), pruned.eval().to(device), mask.to(device), source


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    full, pruned, mask, source = models(args)
    T = args.frames * full.config.stack
    g = torch.Generator().manual_seed(args.seed)
    features = torch.randn(args.batch, T, full.config.feature_dim, generator=g).to(device)
    lengths = torch.full((args.batch,), T, dtype=torch.long, device=device)

    def forward(model: AALBERT, head_mask: Tensor | None) -> list[Tensor]:
        with torch.no_grad(), autocast(device.type, args.precision):
            return model(features, lengths, head_mask)

    cases = {
        "masked": functools.partial(forward, full, mask.to(torch.float32)),
        "pruned": functools.partial(forward, pruned, None),
    }
    outputs = {name: fn()[-1].float() for name, fn in cases.items()}  # warm-up
    diff = float((outputs["masked"] - outputs["pruned"]).abs().max())
    times = round_robin(cases, args.reps, device)
    rows = {
        name: {
            "time_ms": 1e3 * min(times[name]),
            "time_ms_median": 1e3 * statistics.median(times[name]),
            "peak_mem_mb": peak_memory(cases[name], device),
            "params": sum(p.numel() for p in model.parameters()),
            "param_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        }
        for name, model in (("masked", full), ("pruned", pruned))
    }
    heads = [layer.attention.num_heads for layer in pruned.encoder.layers]
    c, s = full.config, setting(args)
    print(
        f"pruning: {args.upstream or args.model} ({c.attention}, "
        f"{'shared' if c.shared else 'unshared'} layers, L={c.num_layers}, h={c.num_heads}), "
        f"batch {args.batch} x {args.frames} frames, {s['device']} ({s['device_name']}), "
        f"{s['precision']}, {s['threads']} threads"
    )
    print(
        f"  mask: {source}; {int((mask == 0).sum())} of {mask.numel()} head applications masked; "
        f"heads left per layer {heads}; residual head mask: "
        f"{'yes' if pruned.config.residual_head_mask else 'no'}; max |masked - pruned| {diff:.2e}"
    )
    for name, r in rows.items():
        mem = "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.1f}"
        print(
            f"  {name:7s} {r['time_ms']:9.2f} ms (median {r['time_ms_median']:.2f})  "
            f"peak memory {mem} MiB  params {r['params'] / 1e6:.3f} M ({r['param_mb']:.1f} MiB)"
        )
    m, p = rows["masked"], rows["pruned"]
    speedup = m["time_ms"] / p["time_ms"]
    measured = p["peak_mem_mb"] and m["peak_mem_mb"]
    mem_ratio = p["peak_mem_mb"] / m["peak_mem_mb"] if measured else None
    print(
        f"  speed-up (masked / pruned time) {speedup:.2f}x; pruned peak memory "
        f"{'-' if mem_ratio is None else f'{mem_ratio:.2f}x'} of masked; parameters "
        f"{p['params'] / m['params']:.2f}x"
    )
    result = {
        "benchmark": "pruning",
        "upstream": args.upstream,
        "model": None if args.upstream else args.model,
        "attention": c.attention,
        "shared": c.shared,
        "mask_source": source,
        "mask": mask.tolist(),
        "heads_left": heads,
        "batch": args.batch,
        "frames": args.frames,
        **s,
        "max_abs_diff": diff,
        "rows": rows,
        "speedup": speedup,
        "peak_mem_ratio": mem_ratio,
    }
    write_json(args.json, result)
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser("pruning", __doc__)
    p.add_argument("--upstream", default=None, help="upstream.pt (default: --model, random)")
    p.add_argument("--model", default="aalbert_base", choices=sorted(PRESETS))
    p.add_argument("--attention", default="full", help="with --model: the variant")
    p.add_argument("--heads", default=None, help="heads.json whose pruning point to use")
    p.add_argument("--fraction", type=float, default=0.5, help="fraction of heads masked")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--frames", type=int, default=500, help="stacked 30 ms frames per utterance")
    p.add_argument("--reps", type=int, default=10)
    add_run_arguments(p, clock=False)
    return finish_run_arguments(p.parse_args(argv))


def main(argv: list[str]) -> None:
    run(parse(argv))

"""`python -m speechattn.bench pretrain --compile`: graph breaks and compiled vs eager steps.

Per variant, in one run: the graph breaks of pretraining's compile unit
(`tasks/pretrain/compiled.py`, what `model.compile=true` compiles: embedding, encoder, head,
masked L1) from `torch._dynamo.explain` at the benchmark's batch, with their reasons; the
first compiled step's time (compilation included); then the eager and the compiled training
step (masking, forward, loss, backward, LAMB) timed round-robin, and their ratio.

The backward has no graph breaks of its own to count: AOTAutograd derives it from the forward
graphs, and a custom autograd Function that dynamo cannot trace breaks the forward where it is
applied. The batch has no padding (`--batch` x `--frames` full-length utterances), as in
`bench pretrain`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from speechattn.bench.common import autocast
from speechattn.model.aalbert import padding_mask_for
from speechattn.model.masking import MaskingConfig, mask_batch
from speechattn.tasks.pretrain.compiled import compile_objective, graph_breaks


def explain(model: nn.Module, batch: dict[str, Tensor], masking: MaskingConfig, precision: str):
    """Graph breaks of the compile unit on one masked batch -> {graphs, breaks, reasons}."""
    masked = mask_batch(
        batch["features"], batch["lengths"], batch["stack"], masking, torch.Generator(),
        batch.get("pad_to_multiple", 1),
    )  # fmt: skip
    pad = padding_mask_for(masked.lengths, masked.inputs)
    with autocast(batch["features"].device.type, precision):
        return graph_breaks(model, masked.inputs, masked.target, masked.chosen, pad)


def run_compiled(
    args: argparse.Namespace,
    names: list[str],
    build: Callable[[str], nn.Module],
    make_step: Callable[..., Callable[[], float]],
    batch: dict[str, Tensor],
    time_step: Callable[[Callable[[], float]], float],
) -> list[dict[str, Any]]:
    """Per variant: graph breaks (explain), compile time, eager and compiled step medians.

    `build(name)` gives a fresh model (same weights each call), `make_step(model)` the eager
    step of `bench pretrain` (`make_step(model, objective)` with another objective),
    `time_step(step)` one timed step."""
    masking = MaskingConfig()
    rows = []
    print("graph breaks (torch._dynamo.explain of the compile unit), eager vs compiled step:")
    for name in names:
        info = explain(build(name), batch, masking, args.precision)
        eager = make_step(build(name))
        model = build(name)
        compiled = make_step(model, compile_objective(model))
        for _ in range(args.warmup):
            eager()
        t = time.perf_counter()
        compiled()  # compiles
        first = time.perf_counter() - t
        for _ in range(max(args.warmup - 1, 0)):
            compiled()
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.repeat):  # round-robin: drifting load hits both alike
            times["eager"].append(time_step(eager))
            times["compiled"].append(time_step(compiled))
        e, c = (statistics.median(times[k]) for k in ("eager", "compiled"))
        rows.append({"attention": name, "graphs": info["graphs"], "graph_breaks": info["breaks"],
                     "break_reasons": info["reasons"], "compile_s": first, "eager_s": e,
                     "compiled_s": c, "compiled_vs_eager": c / e})  # fmt: skip
        print(
            f"  {name:15s} breaks {info['breaks']:3d} ({info['graphs']} graphs)  first compiled "
            f"step {first:7.1f} s  eager {e * 1e3:8.1f} ms  compiled {c * 1e3:8.1f} ms  "
            f"compiled/eager {c / e:.2f}"
        )
        for reason, n in Counter(info["reasons"]).most_common(4):
            print(f"      {n:3d} x {reason}")
        torch._dynamo.reset()  # each variant compiles from scratch, within the recompile limit
    return rows


__all__ = ["explain", "run_compiled"]

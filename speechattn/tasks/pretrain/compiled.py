"""torch.compile for pretraining: `masked_reconstruction` (embedding -> encoder -> head ->
masked L1), with static shapes. Design (host-side padding mask, one graph per length bucket,
graph breaks): docs/benchmarks.md#torchcompile.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from speechattn.errors import ConfigError
from speechattn.model.aalbert import padding_mask_for
from speechattn.model.masking import MaskedBatch, masked_l1

# torch.compile modes accepted by `model.compile_mode`
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def masked_reconstruction(
    model: nn.Module, inputs: Tensor, target: Tensor, chosen: Tensor, padding_mask: Tensor | None
) -> Tensor:
    """Masked L1 of AALBERT's reconstruction, `masking.reconstruction_loss` as compiled.

    inputs, target (B, T', stack*F) corrupted and clean stacked frames, chosen (B, T') bool
    frames scored, padding_mask (B, T') True at padding or None (nothing padded) -> loss ().
    """
    h = model.encode(inputs, padding_mask)[-1]  # (B, T', D)
    return masked_l1(model.head(h), target, chosen)


def compile_objective(
    model: nn.Module, mode: str = "default", backend: str = "inductor", max_graphs: int = 64
) -> Callable[[MaskedBatch], Tensor]:
    """`masked_reconstruction` of `model` compiled (the function is `.compiled`), as a function
    of a `MaskedBatch`; dynamo's recompile limit (8, then silently eager) raised to `max_graphs`."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"compile_mode must be one of {COMPILE_MODES}, got {mode!r}")
    if max_graphs > torch._dynamo.config.recompile_limit:
        torch._dynamo.config.recompile_limit = max_graphs

    def objective(inputs: Tensor, target: Tensor, chosen: Tensor, padding_mask: Tensor | None):
        return masked_reconstruction(model, inputs, target, chosen, padding_mask)

    # None: torch.compile's default mode, which backends other than inductor accept too
    compiled = torch.compile(
        objective, backend=backend, mode=None if mode == "default" else mode, dynamic=False
    )

    def loss(masked: MaskedBatch) -> Tensor:
        padding_mask = padding_mask_for(masked.lengths, masked.inputs)  # host-side decision
        return compiled(masked.inputs, masked.target, masked.chosen, padding_mask)

    loss.compiled = compiled  # type: ignore[attr-defined]
    return loss


def graph_breaks(
    model: nn.Module, inputs: Tensor, target: Tensor, chosen: Tensor, padding_mask: Tensor | None
) -> dict[str, Any]:
    """`torch._dynamo.explain` of the compile unit -> {graphs, breaks, reasons (one line each)}."""
    torch._dynamo.reset()
    out = torch._dynamo.explain(masked_reconstruction)(model, inputs, target, chosen, padding_mask)
    torch._dynamo.reset()
    reasons = []
    for r in out.break_reasons:
        what = " ".join(str(r.reason).split()).split(" Explanation:")[0][:100]
        ours = [f for f in r.user_stack if "speechattn" in f.filename]  # innermost last
        where = f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
        reasons.append(what + where)
    return {"graphs": out.graph_count, "breaks": out.graph_break_count, "reasons": reasons}

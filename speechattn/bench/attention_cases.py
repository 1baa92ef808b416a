"""What `python -m speechattn.bench attention` measures: one module at one length (`Case`),
the two SDPA baselines, and the bytes saved for backward. `speechattn.bench.attention` runs
the cases and explains the results; how each figure is taken is described there.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention import Attention, autotune, build, registry
from speechattn.attention.base import linear_flops
from speechattn.attention.lsh import SCHEMES
from speechattn.bench.common import PeakRSS, autocast, peak_memory, time_call

BASELINES = ["sdpa_mha", "sdpa_kernel"]
LSH = set(SCHEMES)
FLEX = "+flex"  # row suffix: the variant with kernel="flex" (CUDA runs add these rows)


def variant_of(row: str) -> tuple[str, dict]:
    """A result row's registry name and the options that distinguish it."""
    if row.endswith(FLEX):
        return row.removesuffix(FLEX), {"kernel": "flex"}
    return row, {}


class BareMHA(nn.Module):
    """`full` without speechattn: qkv Linear -> SDPA -> out Linear (no masks, no checks)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.h = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)  # (B, h, T, d_k)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class KernelOnly(nn.Module):
    """The SDPA call alone on (B, h, T, d_k) leaf tensors."""

    def forward(self, qkv: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        return F.scaled_dot_product_attention(*qkv)


def saved_bytes(fn: Callable[[], Tensor], params: list[Tensor]) -> float:
    """MiB of distinct storages `fn()` saves for backward (`saved_tensors_hooks`), not counting
    storages of `params` (saving a parameter costs no memory)."""
    seen: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t: Tensor) -> Tensor:
        if t.numel() and t.untyped_storage().data_ptr() not in skip:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values()) / 2**20


class Case:
    """One benchmarked module at one length: builds inputs and runs one training step."""

    def __init__(self, name: str, T: int, args: argparse.Namespace, device: torch.device) -> None:
        self.name, self.T, self.device = name, T, device
        self.precision, self.batch, self.dim = args.precision, args.batch, args.dim
        B, D, h = args.batch, args.dim, args.heads
        gen = torch.Generator().manual_seed(T)
        self.options: dict = {}
        if name == "sdpa_mha":
            self.module: nn.Module = BareMHA(D, h)
        elif name == "sdpa_kernel":
            self.module = KernelOnly()
        else:
            variant, self.options = variant_of(name)
            defaults = registry.options(variant)
            if "max_len" in defaults and defaults["max_len"] < T:
                self.options["max_len"] = T
            self.module = build(variant, D, h, **self.options)
            autotune.enable(self.module, args.autotune == "on")
        self.module.to(device)
        if name == "sdpa_kernel":
            shape = (B, h, T, D // h)
            self.inputs = tuple(
                torch.randn(shape, generator=gen).to(device).requires_grad_() for _ in range(3)
            )
        else:
            self.inputs = torch.randn(B, T, D, generator=gen).to(device).requires_grad_()
        if getattr(self.module, "autotune", False):
            with torch.no_grad():  # choose the kernel now: outside every timed or measured step
                self.forward()

    def forward(self) -> Tensor:
        with autocast(self.device.type, self.precision):
            return self.module(self.inputs)

    def flops(self) -> float:
        """Training FLOPs of one step (forward + backward) as the module is defined."""
        B, T, D = self.batch, self.T, self.dim
        if isinstance(self.module, Attention):
            return B * self.module.flops(T).training
        attention = 3 * 4.0 * T * T * D  # SDPA: scores and weighted sums, forward + backward
        projections = 3 * linear_flops(T, D, 4 * D) if self.name == "sdpa_mha" else 0.0
        return B * (attention + projections)

    def _zero(self) -> None:
        for p in self.module.parameters():
            p.grad = None
        for t in self.inputs if isinstance(self.inputs, tuple) else (self.inputs,):
            t.grad = None

    def step(self) -> None:
        self.time_step(time.perf_counter)

    def time_step(self, clock: Callable[[], float]) -> float:
        """Milliseconds of one training step (forward + backward) by `clock`."""
        self._zero()
        ms = 1000 * time_call(lambda: self.forward().float().sum().backward(), self.device, clock)
        self._zero()  # free gradients (large for synthesizer tables) before the next case
        return ms

    def time_select(self, clock: Callable[[], float]) -> float:
        """LSH only: hashing + matching + top-k on this input, no gradient (ms)."""
        attn: Attention = self.module
        with torch.no_grad(), autocast(self.device.type, self.precision):
            valid = torch.ones(self.inputs.shape[:2], dtype=torch.bool, device=self.device)
            q, k, _ = attn._qkv(self.inputs)
            return 1000 * time_call(lambda: attn.select(q, k, valid), self.device, clock)

    def memory(self, rss: PeakRSS) -> tuple[float | None, float]:
        """(peak MiB of one step, MiB saved for backward)."""
        peak = peak_memory(self.step, self.device, rss)
        return peak, saved_bytes(self.forward, list(self.module.parameters()))

    def params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

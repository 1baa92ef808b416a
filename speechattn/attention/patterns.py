"""Pure pattern builders (no parameters, no compute kernels): boolean (T, T) masks, True where
query i (row) may attend key j (column), for the dense references, tests, the visualiser and
the sparse variants' masked and Flex kernels (from the same elementwise predicates); and the
fixed patterns of Raganato et al. (2020) that initialise `syn_fixed`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from speechattn.errors import ConfigError

# Order of the fixed patterns (Raganato et al. 2020), i.e. of the first heads of syn_fixed.
FIXED_PATTERN_NAMES = ("current", "previous", "next", "left", "right", "start", "end")


def default_stride(num_valid: int) -> int:
    """l ~ sqrt(T) for an utterance of `num_valid` frames (Child et al. 2019), at least 1."""
    return max(1, round(math.sqrt(num_valid)))


def default_strides(num_valid: Tensor) -> Tensor:
    """`default_stride` of each entry of an int tensor, on its device (no host read):
    sqrt(n) is never a tie x + 1/2, and float64 resolves the gap far beyond any length."""
    return (num_valid.double().sqrt() + 0.5).floor().long().clamp_min(1)


def stride_bounds(T: int) -> tuple[int, int]:
    """Static bounds on the default strides of utterances of at most T frames: (L, M) with
    L = default_stride(T) >= every l and M >= ceil(e / l) for any e <= T, l = default_stride(e)
    (round(sqrt(e)) = l gives e <= l^2 + l, so ceil(e / l) <= l + 1 <= L for l < L)."""
    L = default_stride(T)
    return L, max(-(-T // L), L)


# A pattern's width or stride: one for the batch (int), or one per utterance ((B,) long).
Width = int | Tensor


# Elementwise predicates of positions i, j (broadcastable tensors) and a width (int or tensor),
# called by the builders below, the per-utterance masks and the FlexAttention mask_mods.
def in_band(i: Tensor, j: Tensor, width: Width) -> Tensor:
    """|i - j| <= width."""
    return (i - j).abs() <= width


def same_residue(i: Tensor, j: Tensor, stride: Width) -> Tensor:
    """(i - j) mod l = 0."""
    return (i - j) % stride == 0


def same_block(i: Tensor, j: Tensor, block: Width) -> Tensor:
    """floor(i / l) = floor(j / l)."""
    return i // block == j // block


def summary_key(j: Tensor, block: Width, summary: Width) -> Tensor:
    """j mod l >= l - c: the last c keys of every block of l (c <= l, clipped by the caller)."""
    return j % block >= block - summary


def grid(T: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Query and key positions (T, 1) and (1, T), broadcast against each other to (T, T)."""
    i = torch.arange(T, device=device)[:, None]
    return i, i.view(1, T)


def per_utterance(width: Width) -> Width:
    """An int as is; a (B,) tensor as (B, 1, 1), so that a predicate on `grid` positions
    gives one (T, T) pattern per utterance, (B, T, T)."""
    return width.view(-1, 1, 1) if isinstance(width, Tensor) else width


def _device(width: Width, device: torch.device | None) -> torch.device | None:
    return width.device if isinstance(width, Tensor) and device is None else device


def band_pattern(T: int, width: Width, device: torch.device | None = None) -> Tensor:
    """Local band |i - j| <= width, (T, T) bool, or (B, T, T) for per-utterance widths
    (strided pattern, first half of the heads)."""
    i, j = grid(T, _device(width, device))
    return in_band(i, j, per_utterance(width))


def strided_pattern(T: int, stride: Width, device: torch.device | None = None) -> Tensor:
    """Residue classes (i - j) mod l = 0, (T, T) or (B, T, T) bool (strided pattern, second
    half)."""
    i, j = grid(T, _device(stride, device))
    return same_residue(i, j, per_utterance(stride))


def hankel(values: Tensor, L: int, Lk: int) -> Tensor:
    """The strided view (..., L, Lk) with [a, w] = values[..., a + w] of values
    (..., L + Lk - 1), no copy. With the keys reversed (w = Lk - 1 - j) it lays a function of
    a - j over (query, key) without a flip: CPU flash attention reads such a mask by stride."""
    values = values.contiguous()
    return values.as_strided((*values.shape[:-1], L, Lk), (*values.stride()[:-1], 1, 1))


def toeplitz(values: Tensor, L: int, Lk: int) -> Tensor:
    """(..., L, Lk) with [a, w] = values[..., a - w + Lk - 1] of values (..., L + Lk - 1) at
    offsets -(Lk - 1) .. L - 1: the Hankel view flipped (one copy), so a function of the offset
    is evaluated (and differentiated) once per offset, not once per pair."""
    return hankel(values, L, Lk).flip(-1)


def global_pattern(T: int, every: int, device: torch.device | None = None) -> Tensor:
    """Rows and columns of the global frames i mod g = 0, (T, T) bool: a global frame attends to
    every frame and every frame attends to it (Longformer)."""
    i, j = grid(T, device)
    return (i % every == 0) | (j % every == 0)


def mean_band_size(T: int, width: int) -> float:
    """Keys |i - j| <= width inside [0, T), averaged over the T queries."""
    i = torch.arange(T, dtype=torch.float64)
    return float((torch.clamp(i + width, max=T - 1) - torch.clamp(i - width, min=0) + 1).mean())


def window_keys(
    T: int, width: int, step: int = 1, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Keys j = i + step * o, o in [-width, width], of each query: positions and in_range
    (0 <= j < T), (T, 2 width + 1) each, O(T width) memory (LDSA's and Longformer's windows)."""
    i = torch.arange(T, device=device)[:, None]
    j = i + step * torch.arange(-width, width + 1, device=device)  # (T, 2 width + 1)
    return j, (j >= 0) & (j < T)


def fixed_pattern(name: str, n: int, context: int = 3) -> Tensor:
    """One fixed pattern of Raganato et al. (2020) on an n x n grid: (n, n) float32, rows
    summing to 1 where the pattern has a target, else 0. current: j = i; previous: j = i - 1;
    next: j = i + 1; left / right: the `context` frames before / after i (uniform); start:
    j = 0; end: j = n - 1. Band operations only (n = 8192: one 256 MiB matrix)."""
    ones = torch.ones(n, n)
    if name == "current":
        return torch.eye(n)
    if name == "previous":
        return ones.tril(-1).triu(-1)
    if name == "next":
        return ones.triu(1).tril(1)
    if name in ("left", "right"):
        band = ones.tril(-1).triu(-context) if name == "left" else ones.triu(1).tril(context)
        return band / band.sum(-1, keepdim=True).clamp_min(1)
    if name in ("start", "end"):
        out = torch.zeros(n, n)
        out[:, 0 if name == "start" else n - 1] = 1
        return out
    raise ConfigError(f"unknown fixed pattern {name!r}; valid: {', '.join(FIXED_PATTERN_NAMES)}")


def fixed_patterns(n: int, context: int = 3) -> Tensor:
    """All 7 fixed patterns in FIXED_PATTERN_NAMES order: (7, n, n) float32."""
    return torch.stack([fixed_pattern(name, n, context) for name in FIXED_PATTERN_NAMES])

"""Pattern builders: elementwise predicates of query i and key j (True: i may attend j) for the
dense references and the masked and Flex kernels alike, strided layouts, and the fixed patterns
of Raganato et al. (2020) that initialise `syn_fixed`.
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
    (e <= l^2 + l, so ceil(e / l) <= l + 1 <= L for l < L)."""
    L = default_stride(T)
    return L, max(-(-T // L), L)


# A pattern's width or stride: one for the batch (int), or one per utterance ((B,) long).
Width = int | Tensor


# Elementwise predicates of positions i, j (broadcastable tensors) and a width (int or tensor).
def in_band(i: Tensor, j: Tensor, width: Width) -> Tensor:
    return (i - j).abs() <= width


def same_residue(i: Tensor, j: Tensor, stride: Width) -> Tensor:
    return (i - j) % stride == 0


def same_block(i: Tensor, j: Tensor, block: Width) -> Tensor:
    return i // block == j // block


def summary_key(j: Tensor, block: Width, summary: Width) -> Tensor:
    """The last c keys of every block of l (c <= l, clipped by the caller)."""
    return j % block >= block - summary


def grid(T: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Query and key positions (T, 1) and (1, T), broadcast against each other to (T, T)."""
    i = torch.arange(T, device=device)[:, None]
    return i, i.view(1, T)


def per_utterance(width: Width) -> Width:
    """An int as is; a (B,) tensor as (B, 1, 1): one (T, T) pattern per utterance on `grid`."""
    return width.view(-1, 1, 1) if isinstance(width, Tensor) else width


def band_pattern(T: int, width: int, device: torch.device | None = None) -> Tensor:
    """Local band |i - j| <= width, (T, T) bool."""
    return in_band(*grid(T, device), width)


def hankel(values: Tensor, L: int, Lk: int) -> Tensor:
    """The strided view (..., L, Lk) with [a, w] = values[..., a + w] of values
    (..., L + Lk - 1), no copy: with the keys reversed, a function of a - j that CPU flash
    attention reads by stride."""
    values = values.contiguous()
    return values.as_strided((*values.shape[:-1], L, Lk), (*values.stride()[:-1], 1, 1))


def toeplitz(values: Tensor, L: int, Lk: int) -> Tensor:
    """(..., L, Lk) with [a, w] = values[..., a - w + Lk - 1] of values (..., L + Lk - 1): the
    Hankel view flipped (one copy), so a function of the offset is computed once per offset."""
    return hankel(values, L, Lk).flip(-1)


def mean_band_size(T: int, width: int) -> float:
    """Keys |i - j| <= width inside [0, T), averaged over the T queries."""
    i = torch.arange(T, dtype=torch.float64)
    return float((torch.clamp(i + width, max=T - 1) - torch.clamp(i - width, min=0) + 1).mean())


def window_keys(
    T: int, width: int, step: int = 1, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Keys j = i + step * o, o in [-width, width], of each query: positions and whether
    0 <= j < T, (T, 2 width + 1) each."""
    i = torch.arange(T, device=device)[:, None]
    j = i + step * torch.arange(-width, width + 1, device=device)  # (T, 2 width + 1)
    return j, (j >= 0) & (j < T)


def fixed_pattern(name: str, n: int, context: int = 3) -> Tensor:
    """One fixed pattern of Raganato et al. (2020): (n, n) float32, rows summing to 1 where
    the pattern has a target, else 0; left / right: the `context` frames before / after i
    (uniform). Band operations only (n = 8192: one 256 MiB matrix)."""
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
    """(7, n, n) float32, FIXED_PATTERN_NAMES order."""
    return torch.stack([fixed_pattern(name, n, context) for name in FIXED_PATTERN_NAMES])

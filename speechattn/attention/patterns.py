"""Pure pattern builders (no parameters, no compute kernels).

Boolean (T, T) masks are True where query i (row) may attend key j (column); they are used by
the dense references, by tests, by the visualiser and, as (B, T, T) masks with per-utterance
strides, by the sparse variants' "masked" kernel (`kernels/masked.py`); the same elementwise
predicates are their FlexAttention mask_mods. Also the fixed attention patterns of Raganato et
al. (2020) used to initialise `syn_fixed`.
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
    """`default_stride` of each entry of an int tensor, on its device (no host read).

    sqrt(n) is never a tie x + 1/2 for an integer n, and float64 resolves the gap to the
    nearest tie (about 1 / (8 sqrt(n))) far beyond any sequence length, so floor(sqrt + 1/2)
    equals Python's round.
    """
    return (num_valid.double().sqrt() + 0.5).floor().long().clamp_min(1)


def stride_bounds(T: int) -> tuple[int, int]:
    """Static bounds on the default strides of utterances of at most T frames: (L, M) with
    L = default_stride(T) >= every l (it grows with the length) and M >= ceil(e / l), the
    blocks of l frames in any e <= T frames at l = default_stride(e).

    Why M: round(sqrt(e)) = l means l^2 - l < e <= l^2 + l, so ceil(e / l) <= l + 1 <= L for
    l < L, and ceil(e / L) <= ceil(T / L) for l = L.
    """
    L = default_stride(T)
    return L, max(-(-T // L), L)


# A pattern's width or stride: one for the batch (int), or one per utterance ((B,) long).
Width = int | Tensor


# Elementwise predicates of query positions i and key positions j (broadcastable tensors) and
# a width (an int or a tensor broadcastable with them). The (T, T) builders below, the sparse
# variants' per-utterance masks and their FlexAttention mask_mods all call these, so each
# pattern is written once.
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
    """A function of a + w laid out over (L, Lk): values (..., L + Lk - 1) holds it at
    a + w = 0 .. L + Lk - 2; returns the strided view (..., L, Lk) with [a, w] = values[a + w]
    (no copy). With the keys in reverse order, w = Lk - 1 - j, it lays a function of the offset
    a - j over (query, key) without a flip: CPU flash attention reads such a mask by stride."""
    values = values.contiguous()
    return values.as_strided((*values.shape[:-1], L, Lk), (*values.stride()[:-1], 1, 1))


def toeplitz(values: Tensor, L: int, Lk: int) -> Tensor:
    """A function of the offset a - w laid out over (L, Lk): values (..., L + Lk - 1) holds it
    at offsets -(Lk - 1) .. L - 1 in increasing order; returns (..., L, Lk) with [a, w] =
    values[..., a - w + Lk - 1]. The Hankel view, copied once by the flip, so the function is
    evaluated (and differentiated) once per offset, not once per pair."""
    # [a, w] of the Hankel view is values[a + w], after the flip values[a + Lk - 1 - w]
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


def window_keys(T: int, width: int, step: int = 1) -> tuple[Tensor, Tensor]:
    """Keys of a window around each query, j = i + step * o for o in [-width, width].

    Returns positions (T, 2 width + 1) int64 and in_range (T, 2 width + 1) bool (0 <= j < T):
    O(T width) memory, so keys can be counted at any T without a T x T pattern (LDSA's window,
    Longformer's sliding and dilated windows).
    """
    i = torch.arange(T)[:, None]
    j = i + step * torch.arange(-width, width + 1)  # (T, 2 width + 1)
    return j, (j >= 0) & (j < T)


def fixed_pattern(name: str, n: int, context: int = 3) -> Tensor:
    """One fixed pattern of Raganato et al. (2020) on an n x n grid: (n, n) float32.

    Rows sum to 1 where the pattern has a target and are all-zero otherwise (e.g. "previous"
    of the first frame). current: j = i; previous: j = i - 1; next: j = i + 1; left: the
    `context` frames before i (uniform); right: the `context` frames after i; start: j = 0;
    end: j = n - 1. Built with float32 band operations (no n x n index tensors), so
    n = 8192 costs one 256 MiB matrix.
    """
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

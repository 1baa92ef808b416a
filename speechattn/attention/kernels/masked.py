"""The "masked" kernel of the shared-QK pattern heads (sparse_*, routing's local heads): one
SDPA call per head group over all T x T pairs, the group's pattern predicates (`patterns.py`)
as one (1 or B, 1, T, T) additive mask built on the device. Near unmasked attention's speed at
T ~ 512, where the blocked kernels (`blocks.py`) cut a pattern into sub-problems too small for
a GPU's flash tiles, but all T x T pairs; the tuner measures which wins.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.base import SELF_PENALTY, compute_dtype

# SDPA copies a mask whose rows are not a multiple of this many elements apart (its
# memory-efficient kernel's alignment): rows are allocated padded, so it never has to.
MASK_ALIGN = 8


def pattern_bias(allowed: Tensor, kv: Tensor | None, dtype: torch.dtype) -> Tensor:
    """A head group's pattern as SDPA's additive mask: allowed (T, T) or (1 or B, T, T) bool, kv
    (B, T) allowed keys (None: all) -> (1 or B, 1, T, T) in `dtype`, 0 where both allow,
    SELF_PENALTY on the diagonal (as in `shared_qk`), -inf elsewhere; rows `MASK_ALIGN`-aligned."""
    allowed = allowed if allowed.dim() == 3 else allowed[None]
    if kv is not None:
        allowed = allowed & kv[:, None, :]  # (B, T, T)
    N, T = allowed.shape[0], allowed.shape[-1]
    width = -(-T // MASK_ALIGN) * MASK_ALIGN
    bias = torch.full((N, 1, T, width), float("-inf"), dtype=dtype, device=allowed.device)
    bias = bias[..., :T]
    bias.masked_fill_(allowed[:, None], 0.0)
    bias.diagonal(dim1=-2, dim2=-1).fill_(SELF_PENALTY)
    return bias


def masked_heads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    groups: Sequence[tuple[int, Tensor]],
    kv: Tensor | None,
    p: float = 0.0,
) -> Tensor:
    """q, k, v (B, h, T, d_k) -> (B, h, T, d_k); groups: (heads, allowed (T, T) or (1 or B, T,
    T) bool) of consecutive groups covering all h heads; kv (B, T) or None (nothing padded)."""
    dtype = compute_dtype(q)  # the mask in SDPA's dtype: autocast would cast it otherwise
    outs, start = [], 0
    for n, allowed in groups:
        if n == 0:
            continue
        heads = slice(start, start + n)
        mask = pattern_bias(allowed, kv, dtype)  # (1 or B, 1, T, T)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, heads], k[:, heads], v[:, heads], attn_mask=mask, dropout_p=p
            )
        )
        start += n
    if start != q.shape[1]:
        raise ValueError(f"head groups cover {start} heads, q has {q.shape[1]}")
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

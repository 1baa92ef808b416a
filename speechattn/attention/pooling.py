"""FusedAttention pooling: attention that maps L inputs to 1 output.

    Q = f_Q(X), K = f_K(X), V = f_V(X)            tokens (B, L, u), (B, L, u), (B, L, d)
    alpha = fuse(norm(K^T Q / sqrt(d)))           norm: softmax over keys, (B, L_k, L_q)
                                                  fuse: mean over valid queries -> (B, L)
    Y = g_V(V alpha)                              (B, d) -> g_V

Scales and input forms: docs/attention.md, "FusedAttention pooling".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from speechattn.attention.base import masked_softmax
from speechattn.errors import ConfigError

Norm = Callable[[Tensor, Tensor], Tensor]  # (scores (B, Lk, Lq), key_valid (B, Lk)) -> weights
Fuse = Callable[[Tensor, Tensor], Tensor]  # (weights (B, Lk, Lq), query_valid (B, Lq)) -> (B, Lk)
SCALES = ("value", "key")  # divide K^T Q by sqrt(d) (the definition's) or by sqrt(u)


def softmax_over_keys(scores: Tensor, key_valid: Tensor) -> Tensor:
    """Default norm: softmax over the valid keys, column-wise. (B, Lk, Lq) -> (B, Lk, Lq)."""
    return masked_softmax(scores, key_valid[:, :, None], dim=1)


def mean_over_queries(weights: Tensor, query_valid: Tensor) -> Tensor:
    """Default fuse: mean over the valid queries, row-wise. (B, Lk, Lq) -> (B, Lk)."""
    qv = query_valid.to(weights.dtype)[:, None, :]  # (B, 1, Lq)
    return (weights * qv).sum(-1) / qv.sum(-1).clamp_min(1)


def to_patches(x: Tensor, patch: Sequence[int]) -> Tensor:
    """(B, C, W_1..W_n) -> (B, L, C * prod(dW_i)) non-overlapping patches, row-major order."""
    B, C, *W = x.shape
    if len(W) != len(patch) or any(w % p for w, p in zip(W, patch)):
        raise ValueError(
            f"input spatial size {tuple(W)} is not divisible into patches {tuple(patch)}"
        )
    n = len(W)
    grid = [w // p for w, p in zip(W, patch)]
    shape = [B, C] + [s for g, p in zip(grid, patch) for s in (g, p)]
    t = x.reshape(shape)  # (B, C, g_1, p_1, ..., g_n, p_n)
    perm = [0] + [2 + 2 * i for i in range(n)] + [1] + [3 + 2 * i for i in range(n)]
    return t.permute(perm).reshape(B, math.prod(grid), C * math.prod(patch))  # (B, L, F)


class FusedAttentionPool(nn.Module):
    """L inputs -> 1 output by fused attention. in_dim F (features per token, for the default
    linear f_q, f_k, f_v: (B, L, F) -> (B, L, u | u | d)), out_dim d and qk_dim u default to F;
    g_v maps the pooled (B, d); patch (dW_1..dW_n): the single-tensor form's patches."""

    def __init__(
        self,
        in_dim: int | None = None,
        out_dim: int | None = None,
        qk_dim: int | None = None,
        *,
        f_q: Callable[[Tensor], Tensor] | None = None,
        f_k: Callable[[Tensor], Tensor] | None = None,
        f_v: Callable[[Tensor], Tensor] | None = None,
        norm: Norm = softmax_over_keys,
        fuse: Fuse = mean_over_queries,
        g_v: Callable[[Tensor], Tensor] | None = None,
        patch: Sequence[int] | None = None,
        scale: str = "value",
    ) -> None:
        super().__init__()
        if scale not in SCALES:
            raise ConfigError(
                f"FusedAttentionPool: scale must be 'value' (sqrt(d), the size of V) "
                f"or 'key' (sqrt(u), the size of Q and K), got {scale!r}"
            )
        if in_dim is None and None in (f_q, f_k, f_v):
            raise ConfigError("FusedAttentionPool: give in_dim or all of f_q, f_k, f_v")
        u, d = qk_dim or in_dim, out_dim or in_dim
        self.f_q = f_q if f_q is not None else nn.Linear(in_dim, u)
        self.f_k = f_k if f_k is not None else nn.Linear(in_dim, u)
        self.f_v = f_v if f_v is not None else nn.Linear(in_dim, d)
        self.norm, self.fuse = norm, fuse
        self.g_v = g_v if g_v is not None else nn.Identity()
        self.patch = tuple(patch) if patch is not None else None
        self.scale = scale

    def tokens(self, x: Tensor | Sequence[Tensor]) -> Tensor:
        """A list of L (B, ...) tensors, (B, L, ...), or (B, C, W_1..W_n) with `patch` -> tokens
        (B, L, F), each input (or patch) flattened."""
        if isinstance(x, (list, tuple)):
            x = torch.stack(list(x), dim=1)  # (B, L, C, W_1..W_n)
        if self.patch is not None:
            return to_patches(x, self.patch)
        if x.dim() < 3:
            raise ValueError(
                f"expected a collection (B, L, ...) of L tensors, got shape {tuple(x.shape)}"
            )
        return x.flatten(2)  # (B, L, F)

    def forward(
        self,
        x: Tensor | Sequence[Tensor],
        padding_mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Pool x (`tokens`), padding_mask (B, L) True at padded inputs -> g_V(V alpha) ((B, d)
        by default), and alpha (B, L) with need_weights."""
        tok = self.tokens(x)  # (B, L, F)
        B, L, _ = tok.shape
        if padding_mask is None:
            valid = torch.ones(B, L, dtype=torch.bool, device=tok.device)
        else:
            if padding_mask.shape != (B, L):
                raise ValueError(
                    f"expected padding_mask (B, L) = ({B}, {L}), got {tuple(padding_mask.shape)}"
                )
            valid = ~padding_mask
            tok = tok.masked_fill(padding_mask[..., None], 0.0)
        q, k, v = self.f_q(tok), self.f_k(tok), self.f_v(tok)  # (B, L, u), (B, L, u), (B, L, d)
        size = v.shape[-1] if self.scale == "value" else q.shape[-1]  # d or u
        scores = k @ q.transpose(1, 2) / math.sqrt(size)  # (B, Lk, Lq) = K^T Q / sqrt(d | u)
        alpha = self.fuse(self.norm(scores, valid), valid)  # (B, Lk)
        alpha = alpha * valid  # padded keys carry nothing, also for custom norm/fuse
        y = self.g_v((alpha[:, None, :] @ v).squeeze(1))  # V alpha: (B, d)
        return (y, alpha) if need_weights else y

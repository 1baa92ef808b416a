"""Scaled dot-product attention: `full` and Reformer's `shared_qk`.

* full: Vaswani et al., "Attention Is All You Need", NeurIPS 2017. Separate Q, K, V
  projections, softmax(Q K^T / sqrt(d_k)) V per head.
* shared_qk: Kitaev et al., "Reformer: The Efficient Transformer", ICLR 2020, section 2
  ("Shared-QK Transformer"). One projection gives Q; keys are the per-head L2-normalised
  queries; a query may attend to itself only when it has no other valid key (additive
  SELF_PENALTY = -5e4 on the diagonal).

Both call SDPA with a padded batch's key mask (measured against the alternatives: docs/gpu.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from speechattn.attention import patterns
from speechattn.attention.base import (
    SELF_PENALTY,
    Attention,
    AttentionConfig,
    key_mask,
    scale,
    self_penalty,
    unit_keys,
)
from speechattn.attention.registry import register

FullConfig = AttentionConfig  # no options beyond the shared ones


@register("full")
class FullAttention(Attention):
    """Multi-head scaled dot-product attention with separate Q, K, V projections."""

    Config = FullConfig
    paper = "Vaswani et al., Attention Is All You Need, NeurIPS 2017"
    complexity_training = "O(T^2 D)"
    complexity_inference = "O(T^2 D)"
    head_projections = {"qkv": 3}

    def __init__(self, config: FullConfig) -> None:
        super().__init__(config)
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=config.bias)  # W^Q | W^K | W^V

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q, k, v (B, h, T, d_k)."""
        return tuple(self.split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        mask = None if valid is None else key_mask(valid)[:, None, None, :]  # (B, 1, 1, T)
        return self.sdpa(q, k, v, mask)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        scores = q @ k.transpose(-1, -2) * scale(self.head_dim)  # (B, h, T, T)
        return self.weigh(scores, key_mask(valid)[:, None, None, :], v)


SharedQKConfig = AttentionConfig  # no options beyond the shared ones


class SharedQKBase(Attention):
    """Shared-QK projections and scores."""

    head_projections = {"qv": 2}
    input_projections = 2
    normalize_keys = True  # k = q / ||q|| per head; LSH's option may score q itself

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        self.qv = nn.Linear(config.dim, 2 * config.dim, bias=config.bias)  # W^Q | W^V

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q, k, v (B, h, T, d_k)."""
        q, v = self.qv(x).chunk(2, dim=-1)  # 2 x (B, T, D)
        q, v = self.split_heads(q), self.split_heads(v)  # (B, h, T, d_k)
        return q, unit_keys(q) if self.normalize_keys else q, v

    def shared_scores(self, q: Tensor, k: Tensor) -> Tensor:
        """Dense scores (B, h, T, T) with the self penalty on the diagonal."""
        T = q.shape[-2]
        return q @ k.transpose(-1, -2) * scale(self.head_dim) + self_penalty(T, q.device, q.dtype)


@register("shared_qk")
class SharedQKAttention(SharedQKBase):
    """Reformer shared-QK attention over all valid keys."""

    Config = SharedQKConfig
    paper = "Kitaev et al., Reformer: The Efficient Transformer, ICLR 2020"
    complexity_training = "O(T^2 D)"
    complexity_inference = "O(T^2 D)"

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        T = x.shape[1]
        if x.device.type == "cpu" and valid is None:
            # Keys reversed put the self penalty on the anti-diagonal, a strided view of 2T - 1
            # numbers (a T x T mask costs at long T); CUDA's kernels want a dense mask.
            line = torch.zeros(2 * T - 1, dtype=q.dtype, device=x.device)
            line[T - 1] = SELF_PENALTY
            mask = patterns.hankel(line, T, T)[None, None]  # (1, 1, T, T), [i, j'] = line[i + j']
            return self.sdpa(q, k.flip(-2), v.flip(-2), mask)
        mask = self_penalty(T, x.device, q.dtype)[None, None]  # (1, 1, T, T)
        if valid is not None:
            pad = torch.zeros(valid.shape, dtype=q.dtype, device=x.device)
            pad = pad.masked_fill(~key_mask(valid), float("-inf"))  # (B, T)
            mask = mask + pad[:, None, None, :]  # (B, 1, T, T)
        return self.sdpa(q, k, v, mask)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        return self.weigh(self.shared_scores(q, k), key_mask(valid)[:, None, None, :], v)

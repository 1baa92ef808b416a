"""Kernelised linear attention: `linear`.

Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast Autoregressive Transformers
with Linear Attention", ICML 2020 (arXiv:2006.16236), section 3.2, non-causal form. Per head,
with phi(x) = elu(x) + 1 and separate Q, K, V projections as in `full` (no 1/sqrt(d_k): phi
replaces the softmax's exponential, eq. 6):

    y_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j))      over valid keys j

`LinearKernel` forms S = phi(K)^T V (B, h, d_k, d_k) and z = sum_j phi(k_j) once per sequence,
sums of T positive terms: both paths run in float32, autocast off. Attention dropout drops key
columns of the numerator only, as dropout after a softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from speechattn.attention.base import AttentionConfig, Flops, key_mask, linear_flops, widen
from speechattn.attention.dot_product import FullAttention
from speechattn.attention.kernels.linear import LinearKernel, phi
from speechattn.attention.registry import register


@dataclass
class LinearConfig(AttentionConfig):
    """No options beyond the shared ones (the feature map is the paper's elu(x) + 1)."""


@register("linear")
class LinearAttention(FullAttention):
    """Non-causal linear attention with the feature map elu(x) + 1."""

    Config = LinearConfig
    paper = (
        "Katharopoulos et al., Transformers are RNNs: Fast Autoregressive Transformers with "
        "Linear Attention, ICML 2020"
    )
    complexity_training = "O(T D d_k)"
    complexity_inference = "O(T D d_k)"

    def flops(self, T: int) -> Flops:
        D, E, dk = self.dim, self.inner_dim, self.head_dim  # E = h d_k (D unless pruned)
        state = 2 * 2.0 * T * E * dk  # phi(K)^T V and phi(Q) S, all heads
        normaliser = 2 * 2.0 * T * E  # z = sum_j phi(k_j) and phi(Q) z
        return Flops(linear_flops(T, D, 3 * E) + state + normaliser + self.output_flops(T))

    def features(
        self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """phi(Q), phi(K) zeroed at padded keys, and V: (B, h, T, d_k) each, float32 or wider."""
        kv = key_mask(valid)[:, None, :, None]  # (B, 1, T, 1)
        return phi(widen(q)), phi(widen(k)) * kv, widen(v)

    def key_dropout(self, fk: Tensor) -> Tensor:
        """Column mask (B, h, T, 1) of attention dropout, scaled by 1 / (1 - p); ones in eval."""
        return self.drop(fk.new_ones(fk.shape[:-1] + (1,)))

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        with torch.autocast(x.device.type, enabled=False):
            q32, k32, v32 = widen(q), widen(k), widen(v)
            keep = None if valid is None else key_mask(valid)[:, None, :, None].to(q32)
            drop = self.key_dropout(k32) if self.dropout and self.training else None
            out = LinearKernel.apply(q32, k32, v32, keep, drop)
        return out.to(v.dtype)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        with torch.autocast(x.device.type, enabled=False):
            fq, fk, v32 = self.features(q, k, v, valid)  # (B, h, T, d_k)
            scores = fq @ fk.transpose(-1, -2)  # (B, h, T, T), zero at padded keys
            rows = scores.sum(-1, keepdim=True)  # (B, h, T, 1) = phi(q_i)^T z
            weights = scores / rows.clamp_min(torch.finfo(rows.dtype).tiny)
            heads = (weights * self.key_dropout(fk).transpose(-1, -2)) @ v32  # (B, h, T, d_k)
        return heads.to(v.dtype), weights

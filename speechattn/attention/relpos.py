"""Relative positional multi-head self-attention (Transformer-XL, as used by Conformer): `relpos`.

* Dai et al., "Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context",
  ACL 2019, section 3.3 (relative positional encodings, terms (a)-(d)).
* Gulati et al., "Conformer: Convolution-augmented Transformer for Speech Recognition",
  Interspeech 2020, section 2.1 (the same attention, bidirectional, in a speech encoder).

Per head, with r_m the sinusoidal embedding of the distance m = i - j, W_R a linear map
without bias (split into heads like Q, K, V) and u_h, v_h learned per-head biases:

    score_ij = ((q_i + u_h)^T k_j + (q_i + v_h)^T (W_R r_{i-j})_h) / sqrt(d_k)

The position term is one (T, 2T - 1) product per head, turned into (T, T) by the relative
shift (Transformer-XL appendix B): the additive mask of one SDPA call on queries q + u.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention.base import AttentionConfig, Flops, key_mask, linear_flops, scale
from speechattn.attention.dot_product import FullAttention
from speechattn.attention.registry import register


def relative_sinusoids(T: int, dim: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Sinusoidal embeddings of the distances m = T-1, ..., -(T-1): (2T - 1, dim), columns
    alternating sin, cos of m / 10000^(2c / dim) (Vaswani et al. 2017, section 3.5); float64
    angles (exact at long T), cast to `dtype`."""
    m = torch.arange(T - 1, -T, -1, device=device, dtype=torch.float64)  # (2T - 1,)
    c = torch.arange(0, dim, 2, device=device, dtype=torch.float64)
    angles = m[:, None] * torch.exp(c * (-math.log(10000.0) / dim))  # (2T - 1, ceil(dim / 2))
    r = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)[:, :dim]  # (2T - 1, dim)
    return r.to(dtype)


def relative_shift(scores: Tensor) -> Tensor:
    """(..., T, 2T - 1) scores against the distances T-1..-(T-1) -> (..., T, T), out[..., i, j]
    = scores[..., i, T - 1 - i + j]: with a zero column in front, the flat (T, 2T) rows read
    as (2T, T), and dropping the first row shifts row i left by T - i."""
    *lead, T, W = scores.shape
    padded = F.pad(scores, (1, 0))  # (..., T, 2T)
    shifted = padded.reshape(*lead, W + 1, T)[..., 1:, :]  # (..., 2T - 1, T)
    return shifted.reshape(*lead, T, W)[..., :T]  # (..., T, T)


@dataclass
class RelPosConfig(AttentionConfig):
    """No options beyond the shared ones (the sinusoids need no maximum length)."""


@register("relpos")
class RelPosAttention(FullAttention):
    """Transformer-XL relative positional self-attention with content and position biases."""

    Config = RelPosConfig
    paper = (
        "Dai et al., Transformer-XL, ACL 2019; Gulati et al., Conformer, Interspeech 2020 "
        "(relative positional multi-head self-attention)"
    )
    complexity_training = "O(T^2 D)"
    complexity_inference = "O(T^2 D)"
    no_weight_decay = ("pos_bias_u", "pos_bias_v")  # per-head biases
    head_projections = {"qkv": 3, "pos_proj": 1}  # W_R r is split into heads too
    head_tensors = no_weight_decay

    def __init__(self, config: RelPosConfig) -> None:
        super().__init__(config)
        h, dk = config.num_heads, config.head_dim
        self.pos_proj = nn.Linear(config.dim, config.dim, bias=False)  # W_R, no bias
        # u (content bias) and v (position bias) per head, Xavier-uniform as in Conformer code
        self.pos_bias_u = nn.Parameter(nn.init.xavier_uniform_(torch.empty(h, dk)))
        self.pos_bias_v = nn.Parameter(nn.init.xavier_uniform_(torch.empty(h, dk)))

    def flops(self, T: int) -> Flops:
        D, E = self.dim, self.inner_dim  # E = h d_k (D unless pruned)
        projections = linear_flops(T, D, 3 * E) + linear_flops(2 * T - 1, D, E)  # QKV, W_R r
        content = 2 * 2.0 * T * T * E  # (q + u) k^T and weights x V, all heads
        position = 2.0 * T * (2 * T - 1) * E  # (q + v) against the 2T - 1 distances
        return Flops(projections + content + position + self.output_flops(T))

    def _position_scores(self, q: Tensor) -> Tensor:
        """(q + v) against every distance, unshifted: (B, h, T, 2T - 1), row n <-> T - 1 - n."""
        B, h, T, dk = q.shape
        r = relative_sinusoids(T, self.dim, q.device, self.pos_proj.weight.dtype)
        p = self.pos_proj(r).view(2 * T - 1, h, dk).transpose(0, 1)  # (h, 2T - 1, d_k)
        qv = q + self.pos_bias_v.to(q.dtype)[:, None, :]  # (B, h, T, d_k)
        return qv @ p.transpose(-1, -2).to(q.dtype)  # (B, h, T, 2T - 1)

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        bias = relative_shift(self._position_scores(q)) * scale(self.head_dim)  # (B, h, T, T)
        if valid is not None:
            bias = bias.masked_fill(~key_mask(valid)[:, None, None, :], float("-inf"))
        qu = q + self.pos_bias_u.to(q.dtype)[:, None, :]  # (B, h, T, d_k)
        return self.sdpa(qu, k, v, bias.to(qu.dtype))

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        B, h, T, _ = q.shape
        content = (q + self.pos_bias_u.to(q.dtype)[:, None, :]) @ k.transpose(-1, -2)
        i = torch.arange(T, device=x.device)
        column = (T - 1 - (i[:, None] - i[None, :])).expand(B, h, T, T)  # distance i - j's row
        position = self._position_scores(q).gather(-1, column)  # (B, h, T, T)
        scores = (content + position) * scale(self.head_dim)  # (B, h, T, T)
        return self.weigh(scores, key_mask(valid)[:, None, None, :], v)

"""Multi-head local dense synthesizer attention: `ldsa`.

Xu, Li, Zhang, "Transformer-based End-to-End Speech Recognition with Local Dense Synthesizer
Attention", ICASSP 2021 (arXiv:2010.12155), in the multi-head form of the authors' supplement
(docs/attention.md):

    B^i   = softmax(ReLU(X W_1^i) W_2^i)      W_1^i (D, d_k), W_2^i (d_k, c)   -> (T, c)
    V^i   = X W_3^i                           W_3^i (D, d_k)                   -> (T, d_k)
    Y_t^i = sum_{j<c} B^i_{t,j} V^i_{t + j - floor(c/2)}
    Y     = concat_i(Y^i) W^O

The softmax runs over the window positions inside [0, T) and not padded. The efficient path is
c shifted multiply-adds (`LocalWeightedSum`): O(T c D), no T x T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention import patterns
from speechattn.attention.base import (
    Attention,
    AttentionConfig,
    Flops,
    all_valid,
    key_mask,
    linear_flops,
    masked_softmax,
    require,
)
from speechattn.attention.kernels.local import LocalWeightedSum
from speechattn.attention.registry import register


@dataclass
class LDSAConfig(AttentionConfig):
    context: int = 15  # c, odd context width: the frame itself and c // 2 on each side

    def __post_init__(self) -> None:
        super().__post_init__()
        c = self.context
        require(
            c >= 1 and c % 2 == 1, f"ldsa context width c must be a positive odd number, got {c}"
        )


@register("ldsa")
class LDSAttention(Attention):
    """Local dense synthesizer: per-frame weights over a window of c neighbours, per head."""

    Config = LDSAConfig
    paper = (
        "Xu et al., Transformer-based End-to-End Speech Recognition with Local Dense "
        "Synthesizer Attention, ICASSP 2021 (multi-head form: the authors' supplement)"
    )
    complexity_training = "O(T c D)"
    complexity_inference = "O(T c D)"
    head_projections = {"w1": 1, "w3": 1}
    head_tensors = ("w2",)

    def __init__(self, config: LDSAConfig) -> None:
        super().__init__(config)
        h, dk, c = config.num_heads, config.head_dim, config.context
        self.context = c
        self.w1 = nn.Linear(config.dim, config.dim, bias=config.bias)  # W_1^i for all heads
        self.w2 = nn.Parameter(torch.empty(h, dk, c))  # W_2^i
        nn.init.normal_(self.w2, std=dk**-0.5)
        self.w3 = nn.Linear(config.dim, config.dim, bias=config.bias)  # W_3^i (values)

    def keys_attended(self, T: int) -> float:
        # synthesised weights, but over the values of the window's frames inside the utterance
        _, inside = patterns.window_keys(T, self.context // 2)  # (T, c)
        return float(inside.sum(-1).double().mean())

    def flops(self, T: int) -> Flops:
        D, E, c = self.dim, self.inner_dim, self.context  # E = h d_k (D unless pruned)
        projections = 2 * linear_flops(T, D, E)  # W_1 and W_3 (values), all heads
        window = 2 * 2.0 * T * E * c  # ReLU(X W_1^i) W_2^i and the c-frame weighted sums
        return Flops(projections + window + self.output_flops(T))

    def window_weights(self, x: Tensor, valid: Tensor) -> Tensor:
        """B^i renormalised over in-range valid positions: (B, h, T, c)."""
        B, T, _ = x.shape
        r = self.context // 2
        hid = F.relu(self.split_heads(self.w1(x)))  # (B, h, T, d_k)
        logits = torch.einsum("bhtd,hdc->bhtc", hid, self.w2)  # (B, h, T, c)
        kv = F.pad(key_mask(valid), (r, r))  # (B, T + 2r), False out of range
        allowed = kv.unfold(1, self.context, 1)  # (B, T, c): key t + j - r allowed
        return masked_softmax(logits, allowed[:, None])  # (B, h, T, c)

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        valid = all_valid(x) if valid is None else valid
        r = self.context // 2
        w = self.drop(self.window_weights(x, valid))  # (B, h, T, c)
        v = F.pad(self.split_heads(self.w3(x)), (0, 0, r, r))  # (B, h, T + 2r, d_k)
        return LocalWeightedSum.apply(w, v)  # (B, h, T, d_k)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        B, T, _ = x.shape
        w = self.window_weights(x, valid)  # (B, h, T, c)
        cols, inside = patterns.window_keys(T, self.context // 2, device=x.device)  # (T, c)
        idx = cols.clamp(0, T - 1).expand(B, self.num_heads, T, self.context)
        weights = torch.zeros(B, self.num_heads, T, T, dtype=w.dtype, device=x.device)
        weights = weights.scatter_add(-1, idx, w * inside)  # (B, h, T, T), band of width c
        v = self.split_heads(self.w3(x))  # (B, h, T, d_k)
        return self.drop(weights) @ v, weights

"""Adaptive attention span: `adaptive_span`.

Sukhbaatar, Grave, Bojanowski, Joulin, "Adaptive Attention Span in Transformers", ACL 2019,
section 3 ("Adaptive attention span"). Each head h learns a span z_h in [0, S]; its attention
weights over keys at distance x are multiplied by the soft mask

    m_z(x) = clamp((R + z - x) / R, 0, 1)

and renormalised: a_ij = m(x_ij) exp(s_ij) / sum_j' m(x_ij') exp(s_ij'), s = q k^T / sqrt(d_k).
The paper is causal (x = i - j >= 0); speech encoders are bidirectional, so here x = |i - j|:
each head sees z_h + R frames on each side. m(0) = 1, so every query keeps its own key.

The span is learned as z_h / S (the paper's parametrisation), clamped to [0, 1] in the
forward pass and, as in the paper, projected back into [0, 1] after every optimiser step
(`after_optimizer_step`, called by the pretraining task); `spans()` gives the current z (h,). The paper's L1 penalty on the spans is
`auxiliary_loss()` = span_penalty * mean_h z_h (SPEC: lambda mean(z) / S with lambda =
span_penalty * S), which the pretraining task adds to its loss and logs as `aux_loss`
(span_penalty = 0 turns it off). A layer shared across depths (ALBERT) counts once.

Both kernels compute softmax(s + log m) (log 0 = -inf), which equals the renormalised product
above, as one fused SDPA call with the log-mask as additive mask (differentiable in z; it is
computed once per distance and laid out as a strided Toeplitz view, see `_toeplitz`):
* short (T <= `short_path_max_t`): all T x T pairs.
* long: only keys within the reach X = ceil(max_h z_h + R) - 1 (the largest distance with a
  non-zero mask in any head): query blocks of X frames against the previous, own and next
  key blocks, O(T X D) time and O(T X h) memory, never T x T.
The dense reference takes the paper's route: softmax over valid keys, times m, renormalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention import patterns
from speechattn.attention.base import (
    Attention,
    AttentionConfig,
    Flops,
    key_mask,
    linear_flops,
    masked_softmax,
    scale,
    select_,
)
from speechattn.attention.registry import register


@dataclass
class AdaptiveSpanConfig(AttentionConfig):
    max_span: int = 256  # S, longest learnable span in frames (7.7 s of 30 ms frames)
    ramp: int = 32  # R, width of the soft mask's linear ramp (frames)
    init_span: float = 0.25  # z / S at initialisation (SPEC: z = S / 4)
    span_penalty: float = 2e-6  # the paper's L1 coefficient per frame of mean span

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_span < 1 or self.ramp < 1:
            raise ValueError(
                f"adaptive_span needs max_span >= 1 and ramp >= 1, got max_span={self.max_span}, "
                f"ramp={self.ramp}"
            )
        if not 0.0 <= self.init_span <= 1.0:
            raise ValueError(f"init_span is a fraction of max_span in [0, 1], got {self.init_span}")
        if self.span_penalty < 0:
            raise ValueError(f"span_penalty must be >= 0, got {self.span_penalty}")


@register("adaptive_span")
class AdaptiveSpanAttention(Attention):
    """Scaled dot-product attention whose weights each head masks to its learned span."""

    Config = AdaptiveSpanConfig
    paper = "Sukhbaatar et al., Adaptive Attention Span in Transformers, ACL 2019"
    complexity_training = "O(T min(T, z + R) D), z <= S the largest learned span"
    complexity_inference = "O(T min(T, z + R) D), z <= S the largest learned span"
    # All T x T pairs in one SDPA call up to here, the band of blocks above (measured
    # crossover with the initial spans, X = 95: 1.00x at T = 448, 0.95x at 512, 0.84x at 640).
    short_path_max_t = 448

    def __init__(self, config: AdaptiveSpanConfig) -> None:
        super().__init__(config)
        self.max_span, self.ramp = config.max_span, config.ramp
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=config.bias)  # W^Q | W^K | W^V
        # z_h / S per head; learned, clamped to [0, 1] where used
        self.span_fraction = nn.Parameter(torch.full((config.num_heads,), config.init_span))

    # ----------------------------------------------------------------- spans
    def spans(self) -> Tensor:
        """Current spans z (h,) in frames, in [0, S] (differentiable)."""
        return self.span_fraction.clamp(0.0, 1.0) * self.max_span

    def auxiliary_loss(self) -> Tensor:
        """The paper's L1 span penalty, span_penalty * mean_h z_h (a scalar)."""
        return self.config.span_penalty * self.spans().mean()

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The paper's projection of z / S back into [0, 1] after each step: a span pushed to
        0 or S keeps the gradient of the mask's ramp and can move back (a parameter left
        outside would only meet the forward clamp, whose gradient there is 0)."""
        self.span_fraction.clamp_(0.0, 1.0)

    def reach(self) -> int:
        """Largest distance x with m_z(x) > 0 in any head: ceil(max z + R) - 1."""
        return math.ceil(float(self.spans().detach().max()) + self.ramp) - 1

    def soft_mask(self, distance: Tensor) -> Tensor:
        """m_z(x) per head: distance (...) -> (h, ...), in [0, 1].

        Where m reaches 0 (x = z + R) its gradient is taken as 0, the derivative from inside
        the masked region: log m, which the kernels use, has no other finite choice there.
        """
        z = self.spans().view(-1, *([1] * distance.dim()))  # (h, 1, ...)
        raw = (self.ramp + z - distance) / self.ramp
        return raw.clamp(0.0, 1.0) * (raw > 0)

    def log_mask(self, distance: Tensor) -> Tensor:
        """log m_z(x) per head, -inf where m = 0: distance (...) -> (h, ...).

        The clamp keeps log away from 0 so that masked entries get a zero gradient, not NaN.
        """
        m = self.soft_mask(distance)
        return m.clamp_min(torch.finfo(m.dtype).tiny).log().masked_fill(m == 0, float("-inf"))

    def _toeplitz(self, c: int, L: int, Lk: int) -> Tensor:
        """log m over an (L, Lk) layout whose query a and key w are c + a - w frames apart:
        (h, L, Lk), differentiable in the spans. log m is computed once per distance and the
        layout is a strided view of it (copied once by the flip): evaluating it elementwise
        on L x Lk distances under autograd made the module 1.2x slower at T = 256."""
        offsets = torch.arange(c - Lk + 1, c + L, device=self.span_fraction.device)
        return patterns.toeplitz(self.log_mask(self._distance(offsets)), L, Lk)

    # ----------------------------------------------------------------- metadata
    def keys_attended(self, T: int) -> float:
        """Keys with a non-zero mask, |i - j| <= ceil(z_h + R) - 1, averaged over queries and
        heads under the current spans."""
        i = torch.arange(T, dtype=torch.float64)
        counts = []
        for z in self.spans().detach().tolist():
            X = math.ceil(z + self.ramp) - 1
            counts.append((torch.clamp(i + X, max=T - 1) - torch.clamp(i - X, min=0) + 1).mean())
        return float(torch.stack(counts).mean())

    def flops(self, T: int) -> Flops:
        D, E = self.dim, self.inner_dim  # E = h d_k (D unless pruned)
        attention = 2 * 2.0 * T * self.keys_attended(T) * E  # scores, weighted sums in span
        return Flops(linear_flops(T, D, 3 * E) + attention + self.output_flops(T))

    def _remove_heads(self, index: Tensor) -> None:
        self._remove_projection_heads(self.qkv, index, blocks=3)
        select_(self, "span_fraction", index)

    # ----------------------------------------------------------------- kernels
    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, D)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B, h, T, d_k)

    def _distance(self, rel: Tensor) -> Tensor:
        """|i - j| in the spans' dtype (a half-precision distance is inexact above 256)."""
        return rel.abs().to(self.span_fraction.dtype)

    def attend(self, x: Tensor, valid: Tensor) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        T = q.shape[-2]
        X = self.reach()
        if T <= self.short_path_max_t or 3 * X >= T:  # the band would cover (nearly) all pairs
            return self._attend_all_pairs(q, k, v, valid)
        return self._attend_band(q, k, v, valid, X)

    def _attend_all_pairs(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> Tensor:
        T = q.shape[-2]
        i = torch.arange(T, device=q.device)
        rel = i[:, None] - i[None, :]  # (T, T) query minus key position
        mask = self._toeplitz(0, T, T)[None]  # (1, h, T, T)
        if not bool(valid.all()):
            # self always allowed (m(0) = 1), so that padded queries far from any valid key
            # keep a finite row (their outputs are zeroed afterwards)
            allowed = key_mask(valid)[:, None, None, :] | (rel == 0)  # (B, 1, T, T)
            mask = mask.masked_fill(~allowed, float("-inf"))  # (B, h, T, T)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), dropout_p=p)

    def _attend_band(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, X: int) -> Tensor:
        """Keys within distance X only: blocks of X queries against the 3X keys of the
        previous, own and next block (every key within reach is among them)."""
        B, h, T, d = q.shape
        n = -(-T // X)  # blocks
        right = n * X - T  # frames padding T up to n X

        def windows(t: Tensor) -> Tensor:  # (B, h, T, d) -> (B, h, n, 3X, d), zero outside
            return F.pad(t, (0, 0, X, right + X)).unfold(2, 3 * X, X).transpose(-1, -2)

        kv = F.pad(key_mask(valid), (X, right + X)).unfold(1, 3 * X, X)  # (B, n, 3X)
        rel = torch.arange(X, device=q.device)[:, None] + X - torch.arange(3 * X, device=q.device)
        allowed = kv[:, None, :, None, :] | (rel == 0)  # (B, 1, n, X, 3X), self as above
        bias = self._toeplitz(X, X, 3 * X)  # (h, X, 3X)
        mask = bias[None, :, None].masked_fill(~allowed, float("-inf"))  # (B, h, n, X, 3X)

        def fold(t: Tensor) -> Tensor:  # (B, h, n, L, e) -> (B n, h, L, e), blocks as batch
            return t.transpose(1, 2).reshape(B * n, h, t.shape[-2], t.shape[-1])

        qb = F.pad(q, (0, 0, 0, right)).view(B, h, n, X, d)
        p = self.dropout if self.training else 0.0
        mask = fold(mask).to(q.dtype)  # (B n, h, X, 3X)
        out = F.scaled_dot_product_attention(
            fold(qb), fold(windows(k)), fold(windows(v)), attn_mask=mask, dropout_p=p
        )  # (B n, h, X, d)
        return out.view(B, n, h, X, d).transpose(1, 2).reshape(B, h, n * X, d)[:, :, :T]

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        T = q.shape[-2]
        scores = q @ k.transpose(-1, -2) * scale(self.head_dim)  # (B, h, T, T)
        probs = masked_softmax(scores, key_mask(valid)[:, None, None, :])
        i = torch.arange(T, device=x.device)
        masked = probs * self.soft_mask(self._distance(i[:, None] - i[None, :]))  # (B, h, T, T)
        # renormalise as in the paper; m(0) = 1 keeps a valid query's sum above 0, the floor
        # only guards padded queries far from every valid key (their rows are zeroed)
        total = masked.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
        weights = masked / total
        return self.drop(weights) @ v, weights

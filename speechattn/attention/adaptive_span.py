"""Adaptive attention span: `adaptive_span`.

Sukhbaatar, Grave, Bojanowski, Joulin, "Adaptive Attention Span in Transformers", ACL 2019,
section 3. Each head h learns a span z_h in [0, S]; its weights over keys at distance x are
multiplied by the soft mask m_z(x) = clamp((R + z - x) / R, 0, 1) and renormalised:
a_ij = m(x_ij) exp(s_ij) / sum_j' m(x_ij') exp(s_ij'), s = q k^T / sqrt(d_k). Bidirectional
here, x = |i - j| (the paper is causal); m(0) = 1, so every query keeps its own key. z_h / S is
learned, clamped in the forward pass and projected back into [0, 1] after every optimiser step;
the paper's L1 penalty is `auxiliary_loss()`. Kernels compute softmax(s + log m), log m once per
distance; at the mask's kinks everything takes the left derivative. Details, kernels and the
kinks: docs/attention.md, "adaptive_span".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention import patterns
from speechattn.attention.autotune import use_short_path
from speechattn.attention.base import (
    AttentionConfig,
    all_valid,
    key_mask,
    masked_softmax,
    needs_static_shapes,
    require,
    scale,
)
from speechattn.attention.dot_product import FullAttention
from speechattn.attention.kernels.span import FlashThenUnfused, UnfusedSavedWeights, flash_cpu
from speechattn.attention.registry import register


def initial_span(init_span: float, max_span: int) -> float:
    """z at initialisation, in frames: init_span S moved half a frame up (down at S), so that
    no key sits on a kink of the mask, where the span's gradient is one-sided."""
    z = init_span * max_span
    return z + 0.5 if z + 0.5 <= max_span else z - 0.5


@dataclass
class AdaptiveSpanConfig(AttentionConfig):
    max_span: int = 256  # S, longest learnable span in frames (7.7 s of 30 ms frames)
    ramp: int = 32  # R, width of the soft mask's linear ramp (frames)
    init_span: float = 0.25  # z / S at initialisation (the study: S / 4), see `initial_span`
    span_penalty: float = 2e-6  # the paper's L1 coefficient per frame of mean span

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.max_span >= 1 and self.ramp >= 2,
            f"adaptive_span needs max_span >= 1 and ramp >= 2, got max_span={self.max_span}, "
            f"ramp={self.ramp}: with ramp = 1 a span pushed to 0 (where the L1 penalty takes "
            "it) has no key on the mask's ramp, so no gradient, and never grows back; set "
            "attention.options.ramp >= 2",
        )
        z, penalty = self.init_span, self.span_penalty
        require(0.0 <= z <= 1.0, f"init_span is a fraction of max_span in [0, 1], got {z}")
        require(penalty >= 0, f"span_penalty must be >= 0, got {penalty}")


@register("adaptive_span")
class AdaptiveSpanAttention(FullAttention):
    """Scaled dot-product attention whose weights each head masks to its learned span."""

    Config = AdaptiveSpanConfig
    paper = "Sukhbaatar et al., Adaptive Attention Span in Transformers, ACL 2019"
    complexity_training = "O(T min(T, z + R) D), z <= S the largest learned span"
    complexity_inference = "O(T min(T, z + R) D), z <= S the largest learned span"
    short_path_max_t = 1024  # all T x T pairs up to here, the band of blocks above
    # On CPU, all pairs keep their weights (`UnfusedSavedWeights`) up to here, then flash.
    saved_weights_max_t = 320
    head_tensors = ("span_fraction",)

    def __init__(self, config: AdaptiveSpanConfig) -> None:
        super().__init__(config)
        self.max_span, self.ramp = config.max_span, config.ramp
        z0 = initial_span(config.init_span, config.max_span)  # z_h / S per head, learned
        self.span_fraction = nn.Parameter(torch.full((config.num_heads,), z0 / config.max_span))

    def spans(self) -> Tensor:
        """Current spans z (h,) in frames, in [0, S] (differentiable)."""
        return self.span_fraction.clamp(0.0, 1.0) * self.max_span

    def auxiliary_loss(self) -> Tensor:
        """The paper's L1 span penalty, span_penalty * mean_h z_h (a scalar)."""
        return self.config.span_penalty * self.spans().mean()

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The paper's projection of z / S back into [0, 1] (outside, the clamp's gradient is 0)."""
        self.span_fraction.clamp_(0.0, 1.0)

    def reach(self, static: bool = False) -> int:
        """Largest distance x with m_z(x) > 0 in any head: ceil(max z + R) - 1 from the
        current spans; with `static` its bound S + R - 1, which reads nothing."""
        if static:
            return self.max_span + self.ramp - 1
        # >= R - 1 >= 1 (ramp >= 2): the band kernel's blocks are never empty
        return math.ceil(float(self.spans().detach().max()) + self.ramp) - 1

    def ramp_position(self, distance: Tensor, z: Tensor | None = None) -> Tensor:
        """(R + z - x) / R per head, distance (...) -> (h, ...): m_z(x) clamped to [0, 1]; x is
        on the ramp where it is in (0, 1]. z (h,) defaults to the current spans."""
        z = self.spans() if z is None else z
        return (self.ramp + z.view(-1, *([1] * distance.dim())) - distance) / self.ramp

    def soft_mask(self, distance: Tensor) -> Tensor:
        """m_z(x) per head: distance (...) -> (h, ...); its gradient at x = z + R is 0 (left)."""
        raw = self.ramp_position(distance)
        return raw.clamp(0.0, 1.0) * (raw > 0)

    def _offsets(self, c: int, L: int, Lk: int) -> Tensor:
        """Distances c + a - w of an (L, Lk) layout, once per offset (`patterns.toeplitz`)."""
        return self._distance(torch.arange(c - Lk + 1, c + L, device=self.span_fraction.device))

    def _toeplitz(self, c: int, L: int, Lk: int) -> Tensor:
        """log m over `_offsets`' layout: (h, L, Lk), differentiable in the spans; -inf where
        m = 0 (the clamp gives those a zero gradient, not NaN)."""
        m = self.soft_mask(self._offsets(c, L, Lk))
        log_m = m.clamp_min(torch.finfo(m.dtype).tiny).log().masked_fill(m == 0, float("-inf"))
        return patterns.toeplitz(log_m, L, Lk)

    def keys_attended(self, T: int) -> float:
        """Keys with a non-zero mask, |i - j| <= ceil(z_h + R) - 1, under the current spans."""
        reach = [math.ceil(z + self.ramp) - 1 for z in self.spans().detach().tolist()]
        counts = [patterns.mean_band_size(T, X) for X in reach]
        return float(torch.tensor(counts, dtype=torch.float64).mean())

    def _distance(self, rel: Tensor) -> Tensor:
        """|i - j| in the spans' dtype (a half-precision distance is inexact above 256)."""
        return rel.abs().to(self.span_fraction.dtype)

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        T = q.shape[-2]
        static = needs_static_shapes(q)  # else the CPU branch reads the spans for its reach
        X = self.reach(static)
        if not static and valid is not None and bool(valid.all()):
            valid = None  # CPU: a free read, and an unpadded batch keeps its masks strided views
        if use_short_path(self, q) or 3 * X >= T:  # the band would cover (nearly) all pairs
            if self._uses_cpu_kernels(q):
                return self._attend_all_pairs_cpu(q, k, v, valid, X)
            return self._attend_all_pairs(q, k, v, valid)
        return self._attend_band(q, k, v, all_valid(x) if valid is None else valid, X)

    def _uses_cpu_kernels(self, q: Tensor) -> bool:
        """CPU eager (SDPA's math path otherwise), not with attention dropout (SDPA draws it)."""
        return not needs_static_shapes(q) and not (self.training and self.dropout)

    @staticmethod
    def _mask_padding(mask: Tensor, valid: Tensor | None, keys_reversed: bool = False) -> Tensor:
        """mask (1, h, T, T) -> (B, h, T, T) with padded keys at -inf (valid None: unchanged);
        the own key stays, so a padded query's row stays finite."""
        if valid is None:
            return mask
        keys, own = key_mask(valid), torch.eye(valid.shape[1], dtype=torch.bool, device=mask.device)
        if keys_reversed:
            keys, own = keys.flip(-1), own.flip(-1)
        return mask.masked_fill(~(keys[:, None, None, :] | own), float("-inf"))

    def _attend_all_pairs(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None) -> Tensor:
        T = q.shape[-2]
        mask = self._mask_padding(self._toeplitz(0, T, T)[None], valid)  # (1 or B, h, T, T)
        return self.sdpa(q, k, v, mask.to(q.dtype))

    def _constant_log_mask(
        self, c: int, L: int, Lk: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """log m and its z-derivative (1 / (R raw) on the ramp, else 0) as constants at
        `_toeplitz`'s offsets: (h, L + Lk - 1) each, for the CPU kernels."""
        raw = self.ramp_position(self._offsets(c, L, Lk), self.spans().detach())
        log_m = raw.clamp(0.0, 1.0).log()  # -inf where m = 0
        return log_m.to(dtype), torch.where(raw.ceil() == 1, 1.0 / (self.ramp * raw), 0.0)

    def _cpu_kernel(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor,
        mask_dz: Tensor,
        reach: int | None = None,
        keys_reversed: bool = False,
        save_weights: bool = False,
    ) -> Tensor:
        """(N, h, L, d) blocks under the constant mask, differentiable in z through mask_dz."""
        z = self.spans()
        if not (torch.is_grad_enabled() and z.requires_grad):
            return flash_cpu(q, k, v, attn_mask=mask)[0]
        if save_weights:
            return UnfusedSavedWeights.apply(q, k, v, z, mask, mask_dz)
        return FlashThenUnfused.apply(q, k, v, z, mask, mask_dz, reach, keys_reversed)

    def _attend_all_pairs_cpu(
        self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, X: int
    ) -> Tensor:
        """All pairs (the backward within reach X); above `saved_weights_max_t` flash with the
        keys reversed, so the mask is a strided view of 2T - 1 values (`patterns.hankel`)."""
        T = q.shape[-2]
        reverse = T > self.saved_weights_max_t
        layout = patterns.hankel if reverse else patterns.toeplitz
        log_m, log_m_dz = self._constant_log_mask(0, T, T, q.dtype)  # offsets 1 - T .. T - 1
        mask = self._mask_padding(layout(log_m, T, T)[None], valid, reverse)  # (1 or B, h, T, T)
        mask_dz = layout(log_m_dz, T, T)[None]  # (1, h, T, T)
        if reverse:
            k, v = k.flip(-2), v.flip(-2)
        return self._cpu_kernel(q, k, v, mask, mask_dz, X, reverse, save_weights=not reverse)

    def _attend_band(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, X: int) -> Tensor:
        """Keys within distance X: blocks of X queries against the previous, own and next."""
        B, h, T, d = q.shape
        n = -(-T // X)  # blocks
        right = n * X - T  # frames padding T up to n X

        def windows(t: Tensor) -> Tensor:  # (B, h, T, d) -> (B, h, n, 3X, d), zero outside
            return F.pad(t, (0, 0, X, right + X)).unfold(2, 3 * X, X).transpose(-1, -2)

        def fold(t: Tensor) -> Tensor:  # (B, h, n, L, e) -> (B n, h, L, e), blocks as batch
            return t.transpose(1, 2).reshape(B * n, h, t.shape[-2], t.shape[-1])

        kv = F.pad(key_mask(valid), (X, right + X)).unfold(1, 3 * X, X)  # (B, n, 3X)
        rel = torch.arange(X, device=q.device)[:, None] + X - torch.arange(3 * X, device=q.device)
        allowed = kv[:, :, None, None, :] | (rel == 0)  # (B, n, 1, X, 3X), self as above
        qb = fold(F.pad(q, (0, 0, 0, right)).view(B, h, n, X, d))
        kb, vb = fold(windows(k)), fold(windows(v))  # (B n, h, 3X, d)

        def block_mask(bias: Tensor) -> Tensor:  # (h, X, 3X) -> (B n, h, X, 3X), -inf outside
            return bias.masked_fill(~allowed, float("-inf")).view(B * n, h, X, 3 * X)

        if self._uses_cpu_kernels(q):
            log_m, log_m_dz = self._constant_log_mask(X, X, 3 * X, q.dtype)
            mask_dz = patterns.toeplitz(log_m_dz, X, 3 * X)[None]
            out = self._cpu_kernel(
                qb, kb, vb, block_mask(patterns.toeplitz(log_m, X, 3 * X)), mask_dz
            )
        else:
            out = self.sdpa(qb, kb, vb, block_mask(self._toeplitz(X, X, 3 * X)).to(q.dtype))
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

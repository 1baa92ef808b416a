"""Bidirectional sparse attention patterns on shared-QK scores: `sparse_strided`, `sparse_fixed`.

Child, Gray, Radford, Sutskever, "Generating Long Sequences with Sparse Transformers", 2019,
section 4.2, made bidirectional as in the study, on `shared_qk`'s scores (self penalised,
always allowed). Options and kernels: docs/attention.md, "Sparse".

* sparse_strided: heads [0, ceil(h/2)) attend to the band |i - j| <= l, the others to the
  residue class (i - j) mod l = 0.
* sparse_fixed: heads [0, ceil(h/2)) attend within their own block floor(i/l) = floor(j/l),
  the others to the c summary columns at the end of every block, j mod l >= l - c.

l (`ls` in the code): the option, or round(sqrt(T_u)) of each utterance's extent T_u, so its
output does not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from speechattn.attention import flex, patterns
from speechattn.attention.autotune import pick_kernel
from speechattn.attention.base import (
    AttentionConfig,
    all_valid,
    key_mask,
    needs_static_shapes,
    require,
)
from speechattn.attention.dot_product import SharedQKBase
from speechattn.attention.kernels.blocks import (
    Kernel,
    Stride,
    band_kernel,
    block_kernel,
    extents,
    residue_kernel,
    summary_kernel,
)
from speechattn.attention.kernels.masked import masked_heads
from speechattn.attention.registry import register

TUNED = ("blocked", "masked", "flex")  # the kernels, each forced by its name
KERNELS = ("auto", *TUNED)  # the option's values
# What `auto` times. Not flex: slowest on an H200 (docs/attention.md), ~20 s to compile a bucket.
AUTO = ("blocked", "masked")
OLD_NAMES = {"sdpa": "blocked"}  # the blocked kernel's name in the first runs' configs
MASKED_MAX_T_CUDA = 1024  # the CUDA rule: masked (all T x T pairs) up to here, blocked above


class _SparseBase(SharedQKBase):
    """Shared-QK sparse attention: heads [0, heads_first) use the first pattern, the others the
    second. A subclass gives `stride_option` (the config field fixing l), `kernels()` (the
    halves' blocked kernels), `first_pattern` / `second_pattern(i, j, ls)` (bool, broadcast),
    `envelope_at(h, i, j, bound)` (every key for any stride <= bound: the Flex BlockMask) and
    `_mean_pattern_size(T)` (keys per query of each half)."""

    end_padded_only = True  # positions place the pattern (see `Attention`)
    all_pairs_kernels = ("masked",)
    stride_option: str

    complexity_training = "O(T sqrt(T) D)"
    complexity_inference = "O(T sqrt(T) D)"

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        self.heads_first = (config.num_heads + 1) // 2

    def _remove_heads(self, index: Tensor) -> None:
        self.heads_first = int((index < self.heads_first).sum())  # still a prefix (sorted)

    def _fixed_stride(self) -> int | None:
        return getattr(self.config, self.stride_option)

    def pattern_pair(
        self, T: int, ls: patterns.Width, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """The halves' bool patterns: (T, T) for one stride ls, (B, T, T) for ls (B,)."""
        i, j = patterns.grid(T, device)
        lb = patterns.per_utterance(ls)
        first, second = self.first_pattern(i, j, lb), self.second_pattern(i, j, lb)
        return first.expand(*first.shape[:-2], T, T), second.expand(*second.shape[:-2], T, T)

    def pattern_at(self, h: Tensor, i: Tensor, j: Tensor, ls: patterns.Width) -> Tensor:
        """Whether head h's query i may use key j with stride ls: both halves by head."""
        first = h < self.heads_first
        return torch.where(first, self.first_pattern(i, j, ls), self.second_pattern(i, j, ls))

    @property
    def kernel_names(self) -> tuple[str, ...]:
        """`AUTO`, or the one the option names."""
        kernel = self.config.kernel
        return AUTO if kernel == "auto" else (kernel,)

    def rule_kernel(self, T: int, device: torch.device) -> str:
        if self.config.kernel != "auto":
            return self.config.kernel
        return "masked" if device.type == "cuda" and T <= MASKED_MAX_T_CUDA else "blocked"

    def strides(self, valid: Tensor) -> list[int]:
        """l per utterance, read on the host: `device_strides`' values."""
        ls = self.device_strides(valid, valid.shape[1])
        return ls.tolist() if isinstance(ls, Tensor) else [ls] * valid.shape[0]

    def device_strides(self, valid: Tensor | None, T: int) -> Stride:
        """l without a host read: the configured one, round(sqrt(T)) when nothing is padded,
        else round(sqrt(T_u)) of each utterance's extent T_u (`extents`) by device ops, (B,)."""
        fixed = self._fixed_stride()
        if fixed is not None:
            return fixed
        if valid is None:  # every utterance spans all T frames
            return patterns.default_stride(T)
        return patterns.default_strides(extents(valid))

    def flex_mask(
        self, ls: Stride, B: int, T: int, device: torch.device
    ) -> tuple[Hashable, flex.MaskMod, flex.MaskMod]:
        """(key, pattern, envelope) for FlexAttention with strides ls (int or (B,)): pattern
        reads ls[b] from a device tensor, so one compiled kernel serves every stride; envelope
        (named by key) allows every key for any stride up to the configured one or the largest
        default of T's Flex bucket, so one BlockMask serves the bucket."""
        fixed = self._fixed_stride()
        ls = ls if isinstance(ls, Tensor) else torch.full((B,), ls, device=device)
        bound = fixed or patterns.stride_bounds(flex.bucket(T))[0]

        def pattern(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return self.pattern_at(h, i, j, ls[b])

        def envelope(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            if fixed is not None:
                return self.pattern_at(h, i, j, fixed)
            return self.envelope_at(h, i, j, bound)

        # the options that shape the envelope (summary: with a configured stride)
        key = (self.name, bound, self.heads_first, fixed, getattr(self.config, "summary", None))
        return key, pattern, envelope

    def _run(self, q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride, kernel: str) -> Tensor:
        """All heads with stride ls (int or (B,)), blocked or Flex kernel -> (B, h, T, d_k)."""
        if kernel == "flex" and flex.use_flex(q, self.training, self.dropout):
            B, _, T, _ = q.shape
            key, pattern, envelope = self.flex_mask(ls, B, T, q.device)
            return flex.pattern_attention(q, k, v, kv, pattern, envelope, key)
        first, second = self.kernels()
        hA, p = self.heads_first, self.dropout_p
        outs = [first(q[:, :hA], k[:, :hA], v[:, :hA], kv, ls, p)] if hA else []
        if hA < self.num_heads:
            outs.append(second(q[:, hA:], k[:, hA:], v[:, hA:], kv, ls, p))
        return torch.cat(outs, dim=1)  # (B, h, T, d_k)

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        kernel = pick_kernel(self, q)
        if kernel == "masked":
            return self.attend_masked(q, k, v, valid)
        kv = all_valid(x) if valid is None else key_mask(valid)  # (B, T)
        if valid is None or self._fixed_stride() is not None or needs_static_shapes(q):
            return self._run(q, k, v, kv, self.device_strides(valid, x.shape[1]), kernel)
        # CPU eager: utterances sharing l run together, trimmed to their extent (host reads).
        ext = extents(valid).tolist()
        strides = [patterns.default_stride(e) for e in ext]
        if len(set(strides)) == 1:
            return self._run(q, k, v, kv, strides[0], kernel)
        out = q.new_zeros(q.shape)
        for ls in sorted(set(strides)):
            group = [b for b, s in enumerate(strides) if s == ls]
            idx = torch.tensor(group, device=x.device)
            Tg = max(1, max(ext[b] for b in group))
            out[idx, :, :Tg] = self._run(
                q[idx, :, :Tg], k[idx, :, :Tg], v[idx, :, :Tg], kv[idx, :Tg], ls, kernel
            )
        return out

    def attend_masked(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None) -> Tensor:
        """q, k, v (B, h, T, d_k), valid (B, T) or None -> (B, h, T, d_k), without a host read."""
        T = q.shape[2]
        first, second = self.pattern_pair(T, self.device_strides(valid, T), q.device)
        groups = [(self.heads_first, first), (self.num_heads - self.heads_first, second)]
        kv = None if valid is None else key_mask(valid)
        return masked_heads(q, k, v, groups, kv, self.dropout_p)

    def allowed_dense(self, valid: Tensor) -> Tensor:
        """(B, h, T, T) bool: the pattern of each head, plus self, restricted to allowed keys."""
        B, T = valid.shape
        eye = torch.eye(T, dtype=torch.bool, device=valid.device)
        hA = self.heads_first
        ls = torch.tensor(self.strides(valid), device=valid.device)  # (B,), read on the host
        a, b = self.pattern_pair(T, ls, valid.device)  # (B, T, T) each
        heads = torch.cat(
            [a[:, None].expand(B, hA, T, T), b[:, None].expand(B, self.num_heads - hA, T, T)],
            dim=1,
        )
        return (heads | eye) & key_mask(valid)[:, None, None, :]

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        return self.weigh(self.shared_scores(q, k), self.allowed_dense(valid), v)

    def keys_attended(self, T: int) -> float:
        a, b = self._mean_pattern_size(T)
        hA = self.heads_first
        return (hA * a + (self.num_heads - hA) * b) / self.num_heads


@dataclass
class SparseConfig(AttentionConfig):
    kernel: str = "auto"  # or "blocked" ("sdpa" in the first runs), "masked", "flex"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.kernel = OLD_NAMES.get(self.kernel, self.kernel)
        require(self.kernel in KERNELS, f"kernel must be one of {KERNELS}, got {self.kernel!r}")


@dataclass
class SparseStridedConfig(SparseConfig):
    stride: int | None = None  # l; None: round(sqrt(T_valid)) per utterance

    def __post_init__(self) -> None:
        super().__post_init__()
        ls = self.stride
        require(ls is None or ls >= 1, f"stride must be >= 1 or None, got {ls}")


@register("sparse_strided")
class SparseStridedAttention(_SparseBase):
    """Bidirectional strided sparse attention: local band and residue classes."""

    Config = SparseStridedConfig
    paper = "Child et al., Generating Long Sequences with Sparse Transformers, 2019 (strided)"
    stride_option = "stride"

    def kernels(self) -> tuple[Kernel, Kernel]:
        return band_kernel, residue_kernel

    first_pattern = staticmethod(patterns.in_band)
    second_pattern = staticmethod(patterns.same_residue)

    def envelope_at(self, h: Tensor, i: Tensor, j: Tensor, bound: int) -> Tensor:
        # residue classes: every key (a block of 128 keys holds every class of l <= 128)
        return (h >= self.heads_first) | patterns.in_band(i, j, bound)

    def _mean_pattern_size(self, T: int) -> tuple[float, float]:
        ls = self._fixed_stride() or patterns.default_stride(T)
        i = torch.arange(T)
        residue = torch.div(T - 1 - (i % ls), ls, rounding_mode="floor").double().add(1).mean()
        return patterns.mean_band_size(T, ls), float(residue)


@dataclass
class SparseFixedConfig(SparseConfig):
    block: int | None = None  # l; None: round(sqrt(T_valid)) per utterance
    summary: int = 1  # c summary columns at the end of each block (clipped to l)

    def __post_init__(self) -> None:
        super().__post_init__()
        ls = self.block
        require(ls is None or ls >= 1, f"block must be >= 1 or None, got {ls}")
        require(self.summary >= 1, f"summary must be >= 1, got {self.summary}")


@register("sparse_fixed")
class SparseFixedAttention(_SparseBase):
    """Bidirectional fixed sparse attention: own block and per-block summary columns."""

    Config = SparseFixedConfig
    paper = "Child et al., Generating Long Sequences with Sparse Transformers, 2019 (fixed)"
    stride_option = "block"

    def kernels(self) -> tuple[Kernel, Kernel]:
        c = self.config.summary

        def summary(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride, p: float) -> Tensor:
            return summary_kernel(q, k, v, kv, ls, c, p)

        return block_kernel, summary

    first_pattern = staticmethod(patterns.same_block)

    def second_pattern(self, i: Tensor, j: Tensor, ls: patterns.Width) -> Tensor:
        c = self.config.summary
        clipped = ls.clamp_max(c) if isinstance(ls, Tensor) else min(c, ls)  # c <= l
        return patterns.summary_key(j, ls, clipped)

    def envelope_at(self, h: Tensor, i: Tensor, j: Tensor, bound: int) -> Tensor:
        # one block: closer than l <= bound; summary columns: every key (each 128 holds some)
        return (h >= self.heads_first) | ((i - j).abs() < bound)

    def _mean_pattern_size(self, T: int) -> tuple[float, float]:
        ls = self._fixed_stride() or patterns.default_stride(T)
        c = min(self.config.summary, ls)
        i = torch.arange(T)
        block = (torch.clamp((i // ls + 1) * ls, max=T) - (i // ls) * ls).double().mean()
        summary = float((i % ls >= ls - c).sum())
        return float(block), summary

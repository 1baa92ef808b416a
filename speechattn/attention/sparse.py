"""Bidirectional sparse attention patterns on shared-QK scores: `sparse_strided`, `sparse_fixed`.

Child, Gray, Radford, Sutskever, "Generating Long Sequences with Sparse Transformers", 2019,
section 4.2 (strided and fixed factorised patterns), made bidirectional as in the study.
Scores are the Reformer shared-QK scores of `shared_qk` (keys = L2-normalised queries, self
penalised by -5e4; the self key is always allowed so that no row is empty).

* sparse_strided: heads [0, ceil(h/2)) attend to the band |i - j| <= l, the other heads to the
  residue class (i - j) mod l = 0.
* sparse_fixed: heads [0, ceil(h/2)) attend within their own block floor(i/l) = floor(j/l), the
  other heads to the c summary columns at the end of every block, j mod l >= l - c.

l ~ sqrt(T): with the default ``stride``/``block`` = None each utterance uses
l = round(sqrt(T_u)) of its own extent T_u (frames up to its last valid one: its length, as
padding comes last), so its output does not depend on what it is batched with. An int fixes l
for all inputs. Per-utterance strides are data: on the CPU (where reading them is free) the
utterances sharing l run together, trimmed to their extent; on CUDA and under torch.compile,
where a host read stalls the device or breaks the graph, one call serves all strides with
shapes fixed by T (`patterns.stride_bounds`: L = round(sqrt(T)) >= every l, M >= blocks per
utterance): each utterance's blocks of l_b frames are gathered into (M, L) slots, attended by
row (block) or column (residue class), and gathered back; the band kernel runs in blocks of L
with radius l_b; the summary keys are gathered per utterance.

Efficient path (never a T x T mask; n = ceil(T / l) blocks; l is `ls` in the code), each
sub-problem one fused SDPA call (flash kernels on CPU and GPU), faster than all-pairs SDPA with
the patterns as a mask at every T >= 128 on CPU in the benchmark (so there is no short-T path). With
the option ``kernel="flex"`` CUDA runs all heads and utterances in one FlexAttention call
instead, the per-utterance strides a tensor its score_mod reads, so it compiles once per length
bucket whatever the strides (flex.py; elsewhere, or with attention dropout in training, the
SDPA sub-problems run):
    band:    each query block against [previous, own, next] key blocks   (B, H, n, l, 3l)
    residue: reshape (n, l) -> (l, n), attend within each residue class   (B, H, l, n, n)
    block:   attend within each block                                      (B, H, n, l, l)
    summary: gather the n*c summary columns, plus the self column          (B, H, T, n c + 1)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from speechattn.attention import flex, patterns
from speechattn.attention.base import (
    AttentionConfig,
    Flops,
    all_valid,
    key_mask,
    masked_softmax,
    needs_static_shapes,
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
from speechattn.attention.registry import register
from speechattn.errors import ConfigError


class _SparseBase(SharedQKBase):
    """Shared-QK sparse attention; subclasses give the two kernels and the two patterns."""

    end_padded_only = True  # positions place the pattern (see `Attention`)

    complexity_training = "O(T sqrt(T) D)"
    complexity_inference = "O(T sqrt(T) D)"

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__(config)
        # heads [0, heads_first) use the first pattern, the others the second
        self.heads_first = (config.num_heads + 1) // 2

    def _remove_heads(self, index: Tensor) -> None:
        self.heads_first = int((index < self.heads_first).sum())  # still a prefix (sorted)
        super()._remove_heads(index)

    def _fixed_stride(self) -> int | None:
        raise NotImplementedError

    def kernels(self) -> tuple[Kernel, Kernel]:
        raise NotImplementedError

    def pattern_pair(self, T: int, ls: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The (T, T) bool patterns of the first and second half of the heads."""
        raise NotImplementedError

    def strides(self, valid: Tensor) -> list[int]:
        """l per utterance, read on the host: the configured one, or round(sqrt(T_u)) of its
        extent T_u (`extents`)."""
        fixed = self._fixed_stride()
        if fixed is not None:
            return [fixed] * valid.shape[0]
        return [patterns.default_stride(e) for e in extents(valid).tolist()]

    def flex_mask(self, ls: Tensor, bound: int) -> tuple[Hashable, flex.MaskMod, flex.MaskMod]:
        """The two patterns by head for FlexAttention with per-utterance strides ls (B,):
        (key, pattern, envelope). pattern(b, h, i, j) reads ls[b] (a tensor, so the compiled
        kernel serves every stride); envelope, named by key for the BlockMask cache, allows
        every key the pattern allows for any stride up to `bound`."""
        raise NotImplementedError

    def flex_strides(self, ls: Stride, B: int, T: int, device: torch.device) -> tuple[Tensor, int]:
        """Strides for `flex_mask`: (B,) on the device (an int filled in, no host copy) and
        their bound, the configured stride or the largest default one of T's Flex bucket (so
        one BlockMask serves the bucket)."""
        strides = ls if isinstance(ls, Tensor) else torch.full((B,), ls, device=device)
        return strides, self._fixed_stride() or patterns.stride_bounds(flex.bucket(T))[0]

    def _run(self, q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride) -> Tensor:
        """All heads with stride ls (int, or (B,) per utterance) -> (B, h, T, d_k)."""
        if self.config.kernel == "flex" and flex.use_flex(q, self.training, self.dropout):
            B, _, T, _ = q.shape
            key, pattern, envelope = self.flex_mask(*self.flex_strides(ls, B, T, q.device))
            return flex.pattern_attention(q, k, v, kv, pattern, envelope, key)
        first, second = self.kernels()
        hA, p = self.heads_first, (self.dropout if self.training else 0.0)
        outs = [first(q[:, :hA], k[:, :hA], v[:, :hA], kv, ls, p)] if hA else []
        if hA < self.num_heads:
            outs.append(second(q[:, hA:], k[:, hA:], v[:, hA:], kv, ls, p))
        return torch.cat(outs, dim=1)  # (B, h, T, d_k)

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k, v = self.shared_qkv(x)  # (B, h, T, d_k)
        fixed = self._fixed_stride()
        if valid is None:  # every utterance spans all T frames: one stride
            return self._run(q, k, v, all_valid(x), fixed or patterns.default_stride(x.shape[1]))
        kv = key_mask(valid)  # (B, T)
        if fixed is not None:
            return self._run(q, k, v, kv, fixed)
        if needs_static_shapes(q):  # the strides stay on the device
            return self._run(q, k, v, kv, patterns.default_strides(extents(valid)))
        # CPU eager: utterances sharing l run together, trimmed to their extent (host reads).
        ext = extents(valid).tolist()
        strides = [patterns.default_stride(e) for e in ext]
        if len(set(strides)) == 1:
            return self._run(q, k, v, kv, strides[0])
        out = q.new_zeros(q.shape)
        for ls in sorted(set(strides)):
            group = [b for b, s in enumerate(strides) if s == ls]
            idx = torch.tensor(group, device=x.device)
            Tg = max(1, max(ext[b] for b in group))
            out[idx, :, :Tg] = self._run(
                q[idx, :, :Tg], k[idx, :, :Tg], v[idx, :, :Tg], kv[idx, :Tg], ls
            )
        return out

    def allowed_dense(self, valid: Tensor) -> Tensor:
        """(B, h, T, T) bool: the pattern of each head, plus self, restricted to allowed keys."""
        B, T = valid.shape
        eye = torch.eye(T, dtype=torch.bool, device=valid.device)
        hA = self.heads_first
        rows = []
        for ls in self.strides(valid):
            a, b = self.pattern_pair(T, ls, valid.device)
            rows.append(torch.stack([a] * hA + [b] * (self.num_heads - hA)) | eye)
        return torch.stack(rows) & key_mask(valid)[:, None, None, :]

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self.shared_qkv(x)  # (B, h, T, d_k)
        weights = masked_softmax(self.shared_scores(q, k), self.allowed_dense(valid))
        return self.drop(weights) @ v, weights  # (B, h, T, d_k), (B, h, T, T)

    def _mean_pattern_size(self, T: int) -> tuple[float, float]:
        raise NotImplementedError

    def keys_attended(self, T: int) -> float:
        a, b = self._mean_pattern_size(T)
        hA = self.heads_first
        return (hA * a + (self.num_heads - hA) * b) / self.num_heads

    def flops(self, T: int) -> Flops:
        return self.shared_flops(T, self.keys_attended(T))


KERNELS = ("sdpa", "flex")


@dataclass
class SparseConfig(AttentionConfig):
    # "sdpa": one SDPA call per sub-problem; "flex": one FlexAttention call on CUDA (flex.py)
    kernel: str = "sdpa"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel not in KERNELS:
            raise ConfigError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")


@dataclass
class SparseStridedConfig(SparseConfig):
    stride: int | None = None  # l; None: round(sqrt(T_valid)) per utterance

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stride is not None and self.stride < 1:
            raise ConfigError(f"stride must be >= 1 or None, got {self.stride}")


@register("sparse_strided")
class SparseStridedAttention(_SparseBase):
    """Bidirectional strided sparse attention: local band and residue classes."""

    Config = SparseStridedConfig
    paper = "Child et al., Generating Long Sequences with Sparse Transformers, 2019 (strided)"

    def _fixed_stride(self) -> int | None:
        return self.config.stride

    def kernels(self) -> tuple[Kernel, Kernel]:
        return band_kernel, residue_kernel

    def flex_mask(self, ls: Tensor, bound: int) -> tuple[Hashable, flex.MaskMod, flex.MaskMod]:
        hA = self.heads_first

        def strided(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            lb = ls[b]
            return torch.where(h < hA, (i - j).abs() <= lb, (i - j) % lb == 0)

        def envelope(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return (h >= hA) | ((i - j).abs() <= bound)  # residue classes: any key

        return (self.name, bound, hA), strided, envelope

    def pattern_pair(self, T: int, ls: int, device: torch.device) -> tuple[Tensor, Tensor]:
        return patterns.band_pattern(T, ls, device), patterns.strided_pattern(T, ls, device)

    def _mean_pattern_size(self, T: int) -> tuple[float, float]:
        ls = self._fixed_stride() or patterns.default_stride(T)
        i = torch.arange(T)
        band = (torch.clamp(i + ls, max=T - 1) - torch.clamp(i - ls, min=0) + 1).double().mean()
        residue = torch.div(T - 1 - (i % ls), ls, rounding_mode="floor").double().add(1).mean()
        return float(band), float(residue)


@dataclass
class SparseFixedConfig(SparseConfig):
    block: int | None = None  # l; None: round(sqrt(T_valid)) per utterance
    summary: int = 1  # c summary columns at the end of each block (clipped to l)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block is not None and self.block < 1:
            raise ConfigError(f"block must be >= 1 or None, got {self.block}")
        if self.summary < 1:
            raise ConfigError(f"summary must be >= 1, got {self.summary}")


@register("sparse_fixed")
class SparseFixedAttention(_SparseBase):
    """Bidirectional fixed sparse attention: own block and per-block summary columns."""

    Config = SparseFixedConfig
    paper = "Child et al., Generating Long Sequences with Sparse Transformers, 2019 (fixed)"

    def _fixed_stride(self) -> int | None:
        return self.config.block

    def kernels(self) -> tuple[Kernel, Kernel]:
        c = self.config.summary

        def summary(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride, p: float) -> Tensor:
            return summary_kernel(q, k, v, kv, ls, c, p)

        return block_kernel, summary

    def flex_mask(self, ls: Tensor, bound: int) -> tuple[Hashable, flex.MaskMod, flex.MaskMod]:
        hA, c = self.heads_first, self.config.summary

        def fixed(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            lb = ls[b]
            return torch.where(h < hA, i // lb == j // lb, j % lb >= lb - lb.clamp_max(c))

        def envelope(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return (h >= hA) | ((i - j).abs() < bound)  # one block: closer than l <= bound

        return (self.name, bound, hA), fixed, envelope

    def pattern_pair(self, T: int, ls: int, device: torch.device) -> tuple[Tensor, Tensor]:
        c = min(self.config.summary, ls)
        return patterns.block_pattern(T, ls, device), patterns.summary_pattern(T, ls, c, device)

    def _mean_pattern_size(self, T: int) -> tuple[float, float]:
        ls = self._fixed_stride() or patterns.default_stride(T)
        c = min(self.config.summary, ls)
        i = torch.arange(T)
        block = (torch.clamp((i // ls + 1) * ls, max=T) - (i // ls) * ls).double().mean()
        summary = float((i % ls >= ls - c).sum())
        return float(block), summary

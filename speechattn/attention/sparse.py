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
sub-problem one fused SDPA call (flash kernels on CPU and GPU), measured faster than all-pairs
SDPA with the patterns as a mask at every T >= 128 on CPU (so there is no short-T path). With
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

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention import flex, patterns
from speechattn.attention.base import (
    SELF_PENALTY,
    AttentionConfig,
    Flops,
    all_valid,
    key_mask,
    masked_softmax,
    needs_static_shapes,
    scale,
)
from speechattn.attention.dot_product import SharedQKBase
from speechattn.attention.registry import register

# l: one stride for the batch (int), or one per utterance ((B,) long, on the device)
Stride = int | Tensor
Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Stride, float], Tensor]


def extents(valid: Tensor) -> Tensor:
    """(B, T) bool -> (B,) long: frames up to each utterance's last valid one (its length when
    padding comes last; 0 when no frame is valid)."""
    T = valid.shape[1]
    frames = torch.arange(1, T + 1, device=valid.device)
    return torch.where(valid, frames, 0).amax(-1)


def _pad_time(t: Tensor, left: int, right: int, dim: int) -> Tensor:
    """Zero/False-pad dimension `dim` of t by (left, right)."""
    pad = [0, 0] * (t.dim() - 1 - dim) + [left, right]
    return F.pad(t, pad)


def _blocks(t: Tensor, ls: int) -> Tensor:
    """(B, H, T, d) -> (B, H, n, l, d), zero-padded to n * l frames."""
    B, H, T, d = t.shape
    n = (T + ls - 1) // ls
    return _pad_time(t, 0, n * ls - T, 2).view(B, H, n, ls, d)


def _valid_blocks(kv: Tensor, ls: int) -> Tensor:
    """(B, T) bool -> (B, n, l) bool, padded with False."""
    B, T = kv.shape
    n = (T + ls - 1) // ls
    return _pad_time(kv, 0, n * ls - T, 1).view(B, n, ls)


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor, p: float) -> Tensor:
    """Per-block softmax attention by one fused SDPA call.

    q (B, H, m, Q, d), k and v (B, H, m, K, d) for m independent blocks; allowed (B, 1, m, Q, K)
    bool, which must allow every query's own key (so no row is empty); bias broadcastable to
    (Q, K), added to the scores. Returns (B, H, m, Q, d). Blocks become SDPA's batch and heads
    its second dim, so one (B m, 1, Q, K) mask serves all heads.
    """
    B, H, m, Q, d = q.shape
    mask = bias.to(q.dtype).masked_fill(~allowed, float("-inf")).transpose(1, 2)  # (B, m, 1, Q, K)

    def fold(t: Tensor) -> Tensor:  # (B, H, m, L, d) -> (B m, H, L, d)
        return t.transpose(1, 2).reshape(B * m, H, t.shape[-2], d)

    out = F.scaled_dot_product_attention(
        fold(q), fold(k), fold(v), attn_mask=mask.reshape(B * m, 1, Q, -1), dropout_p=p
    )  # (B m, H, Q, d)
    return out.view(B, m, H, Q, d).transpose(1, 2)


def _take_frames(t: Tensor, pos: Tensor) -> Tensor:
    """Frames `pos` of each utterance: t (B, H, T, d), pos (B, N) long -> (B, H, N, d)."""
    B, H, _, d = t.shape
    return t.gather(2, pos[:, None, :, None].expand(B, H, -1, d))


def utterance_slots(ls: Tensor, T: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each utterance's blocks of l_b frames in (M, L) slots, (L, M) = stride_bounds(T).

    ls (B,) strides. Returns pos (B, M, L), the frame m l_b + a of slot (m, a) (clamped into
    [0, T)); used (B, M, L), whether that slot holds a frame (a < l_b, m l_b + a < T); slot
    (B, T), the slot m L + a of each frame t = m l_b + a (clamped for frames past the extent,
    which are padding). Every frame before the extent has its own slot.
    """
    L, M = patterns.stride_bounds(T)
    device = ls.device
    lb = ls[:, None, None]  # (B, 1, 1)
    a = torch.arange(L, device=device)
    pos = torch.arange(M, device=device)[:, None] * lb + a  # (B, M, L)
    used = (a < lb) & (pos < T)
    t = torch.arange(T, device=device)
    slot = torch.div(t, ls[:, None], rounding_mode="floor") * L + t % ls[:, None]  # (B, T)
    return pos.clamp_max(T - 1), used, slot.clamp_max(M * L - 1)


def _slot_kernel(
    q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Tensor, p: float, by_class: bool
) -> Tensor:
    """Block (by_class False: attend along each row of slots) or residue (True: along each
    column) pattern with per-utterance strides ls (B,). q, k, v (B, H, T, d) -> (B, H, T, d)."""
    B, H, T, d = q.shape
    pos, used, slot = utterance_slots(ls, T)  # (B, M, L), (B, M, L), (B, T)
    M, L = pos.shape[1:]
    flat = pos.flatten(1)  # (B, M L)
    keys = kv.gather(1, flat).view(B, M, L) & used  # (B, M, L) slots holding an allowed key

    def grid(t: Tensor) -> Tensor:  # (B, H, T, d) -> (B, H, M, L, d), or (B, H, L, M, d)
        g = _take_frames(t, flat).view(B, H, M, L, d)
        return g.transpose(2, 3) if by_class else g

    keys = keys.transpose(1, 2) if by_class else keys  # (B, rows, cols)
    eye = torch.eye(keys.shape[2], dtype=torch.bool, device=q.device)
    allowed = keys[:, None, :, None, :] | eye  # (B, 1, rows, cols, cols)
    bias = eye.to(q.dtype) * SELF_PENALTY
    out = _attend(grid(q), grid(k), grid(v), allowed, bias, p)  # (B, H, rows, cols, d)
    out = out.transpose(2, 3) if by_class else out  # (B, H, M, L, d)
    return _take_frames(out.reshape(B, H, M * L, d), slot)  # (B, H, T, d)


def _dropout(probs: Tensor, p: float) -> Tensor:
    return F.dropout(probs, p) if p else probs


def block_windows(t: Tensor, ls: int, dim: int) -> Tensor:
    """Keys of each query block in the band kernels: the previous, own and next block of l
    frames along `dim` (zero/False outside the sequence).

    (..., T, ...) -> (..., n, 3l, ...), n = ceil(T / l); window position w of block b is frame
    (b - 1) l + w, so a query at offset a of its block is at w = a + l.
    """
    T = t.shape[dim]
    n = (T + ls - 1) // ls
    tp = _pad_time(t, ls, n * ls - T + ls, dim)  # (n + 2) l frames along dim
    parts = [tp.narrow(dim, s * ls, n * ls).unflatten(dim, (n, ls)) for s in range(3)]
    return torch.cat(parts, dim=dim + 1)


def window_offsets(ls: int, device: torch.device) -> Tensor:
    """(l, 3l) query minus key position inside `block_windows`."""
    a = torch.arange(ls, device=device)[:, None]
    w = torch.arange(3 * ls, device=device)[None, :]
    return a + ls - w


def band_kernel(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride, p: float = 0.0) -> Tensor:
    """|i - j| <= l. q, k, v (B, H, T, d), kv (B, T) allowed keys -> (B, H, T, d).

    Per-utterance strides ls (B,): blocks of L >= every l (`patterns.stride_bounds`), each
    utterance's radius masked inside them."""
    B, H, T, d = q.shape
    if isinstance(ls, Tensor):
        width, radius = patterns.stride_bounds(T)[0], ls.view(B, 1, 1, 1, 1)
    else:
        width = radius = ls
    n = (T + width - 1) // width
    qb = _blocks(q, width)  # (B, H, n, l, d)
    kvw = block_windows(kv, width, 1)  # (B, n, 3l)
    rel = window_offsets(width, q.device)  # (l, 3l)
    allowed = ((rel.abs() <= radius) & kvw[:, None, :, None, :]) | (rel == 0)  # (B, 1, n, l, 3l)
    bias = (rel == 0).to(q.dtype) * SELF_PENALTY  # (l, 3l)
    kw, vw = block_windows(k, width, 2), block_windows(v, width, 2)  # (B, H, n, 3l, d)
    out = _attend(qb, kw, vw, allowed, bias, p)  # (B, H, n, l, d)
    return out.reshape(B, H, n * width, d)[:, :, :T]


def residue_kernel(
    q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride, p: float = 0.0
) -> Tensor:
    """(i - j) mod l = 0. q, k, v (B, H, T, d), kv (B, T) -> (B, H, T, d)."""
    if isinstance(ls, Tensor):
        return _slot_kernel(q, k, v, kv, ls, p, by_class=True)
    B, H, T, d = q.shape
    n = (T + ls - 1) // ls

    def classes(t: Tensor) -> Tensor:  # (B, H, T, d) -> (B, H, l, n, d)
        return _blocks(t, ls).transpose(2, 3)

    kvr = _valid_blocks(kv, ls).transpose(1, 2)  # (B, l, n)
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    allowed = kvr[:, None, :, None, :] | eye  # (B, 1, l, n, n)
    bias = eye.to(q.dtype) * SELF_PENALTY  # (n, n)
    out = _attend(classes(q), classes(k), classes(v), allowed, bias, p)  # (B, H, l, n, d)
    return out.transpose(2, 3).reshape(B, H, n * ls, d)[:, :, :T]


def block_kernel(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride, p: float = 0.0) -> Tensor:
    """floor(i / l) = floor(j / l). q, k, v (B, H, T, d), kv (B, T) -> (B, H, T, d)."""
    if isinstance(ls, Tensor):
        return _slot_kernel(q, k, v, kv, ls, p, by_class=False)
    B, H, T, d = q.shape
    eye = torch.eye(ls, dtype=torch.bool, device=q.device)
    allowed = _valid_blocks(kv, ls)[:, None, :, None, :] | eye  # (B, 1, n, l, l)
    bias = eye.to(q.dtype) * SELF_PENALTY  # (l, l)
    out = _attend(
        _blocks(q, ls), _blocks(k, ls), _blocks(v, ls), allowed, bias, p
    )  # (B, H, n, l, d)
    return out.reshape(B, H, -1, d)[:, :, :T]


def summary_columns(T: int, ls: Stride, c: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The summary keys j mod l >= l - min(c, l): positions (1, N) for one stride, (B, N) for
    per-utterance strides (N fixed by T, `patterns.stride_bounds`), clamped into [0, T), and
    (1 or B, N) whether each is one of its utterance's columns inside [0, T)."""
    if isinstance(ls, Tensor):
        L, n = patterns.stride_bounds(T)
        lb = ls[:, None, None]  # (B, 1, 1)
        cb = lb.clamp_max(c)  # its c, clipped to its l
        offset = torch.arange(min(c, L), device=device)
        cols = torch.arange(n, device=device)[:, None] * lb + lb - cb + offset  # (B, n, C)
        real = (offset < cb).expand_as(cols)
    else:
        n, c = (T + ls - 1) // ls, min(c, ls)
        last = torch.arange(ls - c, ls, device=device)  # the last c offsets of a block
        cols = torch.arange(n, device=device)[:, None] * ls + last  # (n, c)
        cols, real = cols[None], torch.ones_like(cols[None], dtype=torch.bool)  # (1, n, c)
    cols, real = cols.flatten(1), real.flatten(1)
    return cols.clamp_max(T - 1), real & (cols < T)


def summary_kernel(
    q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride, c: int, p: float = 0.0
) -> Tensor:
    """j mod l >= l - c, plus the (penalised) self key. q, k, v (B, H, T, d) -> (B, H, T, d)."""
    B, H, T, d = q.shape
    cols, in_range = summary_columns(T, ls, c, q.device)  # (1 or B, N)
    if cols.shape[0] == 1:  # one stride: the same columns for every utterance
        ks, vs = k[:, :, cols[0]], v[:, :, cols[0]]  # (B, H, N, d)
    else:
        ks, vs = _take_frames(k, cols), _take_frames(v, cols)
    s_sum = q @ ks.transpose(-1, -2) * scale(d)  # (B, H, T, N)
    not_self = cols[:, None, :] != torch.arange(T, device=q.device)[:, None]  # (1 or B, T, N)
    real = kv.gather(1, cols.expand(B, -1)) & in_range  # (B, N)
    ok_sum = real[:, None, None, :] & not_self[:, None]  # (B, 1, T, N)
    s_self = (q * k).sum(-1, keepdim=True) * scale(d) + SELF_PENALTY  # (B, H, T, 1)
    ok_self = kv[:, None, :, None]  # (B, 1, T, 1)
    probs = masked_softmax(
        torch.cat([s_sum, s_self], dim=-1),
        torch.cat([ok_sum.expand(B, 1, T, -1), ok_self], dim=-1),
    )  # (B, H, T, N + 1)
    probs = _dropout(probs, p)
    return probs[..., :-1] @ vs + probs[..., -1:] * v


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
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")


@dataclass
class SparseStridedConfig(SparseConfig):
    stride: int | None = None  # l; None: round(sqrt(T_valid)) per utterance

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"stride must be >= 1 or None, got {self.stride}")


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
            raise ValueError(f"block must be >= 1 or None, got {self.block}")
        if self.summary < 1:
            raise ValueError(f"summary must be >= 1, got {self.summary}")


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

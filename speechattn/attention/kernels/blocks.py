"""The blocked kernels of the sparse patterns (and of longformer and routing's local heads):
bands, blocks, residue classes and summary columns, each sub-problem one fused SDPA call
(`sparse.py`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention import patterns
from speechattn.attention.base import SELF_PENALTY, masked_softmax, scale

# l: one stride for the batch (int), or one per utterance ((B,) long, on the device)
Stride = int | Tensor
Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Stride, float], Tensor]


def extents(valid: Tensor) -> Tensor:
    """(B, T) bool -> (B,) long: frames up to each utterance's last valid one (0: none valid)."""
    T = valid.shape[1]
    frames = torch.arange(1, T + 1, device=valid.device)
    return torch.where(valid, frames, 0).amax(-1)


def _pad_time(t: Tensor, left: int, right: int, dim: int) -> Tensor:
    pad = [0, 0] * (t.dim() - 1 - dim) + [left, right]
    return F.pad(t, pad)


def _blocks(t: Tensor, ls: int, dim: int = 2) -> Tensor:
    """Dimension `dim` zero-padded and cut into (n, l), n = ceil(T / l): (B, H, T, d) ->
    (B, H, n, l, d), or with dim = 1 (B, T) -> (B, n, l)."""
    T = t.shape[dim]
    n = (T + ls - 1) // ls
    return _pad_time(t, 0, n * ls - T, dim).unflatten(dim, (n, ls))


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor, p: float) -> Tensor:
    """Per-block softmax attention, one SDPA call with the m blocks as its batch: q (B, H, m, Q,
    d), k and v (B, H, m, K, d), allowed (B, 1, m, Q, K) bool (every query's own key
    allowed), bias broadcastable to (Q, K) -> (B, H, m, Q, d)."""
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
    """Each utterance's blocks of l_b frames in (M, L) slots, (L, M) = stride_bounds(T), for
    strides ls (B,): pos (B, M, L) the frame m l_b + a of slot (m, a) (clamped into [0, T)),
    used (B, M, L) whether it holds one, slot (B, T) the slot m L + a of each frame."""
    L, M = patterns.stride_bounds(T)
    device = ls.device
    lb = ls[:, None, None]  # (B, 1, 1)
    a = torch.arange(L, device=device)
    pos = torch.arange(M, device=device)[:, None] * lb + a  # (B, M, L)
    used = (a < lb) & (pos < T)
    t = torch.arange(T, device=device)
    slot = torch.div(t, ls[:, None], rounding_mode="floor") * L + t % ls[:, None]  # (B, T)
    return pos.clamp_max(T - 1), used, slot.clamp_max(M * L - 1)


def _grid_kernel(
    q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride, p: float, by_class: bool
) -> Tensor:
    """Block (by_class False: along each row of the (blocks, offsets) grid) or residue (True:
    along each column) pattern, q, k, v (B, H, T, d) -> (B, H, T, d); the grid (n, l), or for
    per-utterance strides ls (B,) the (M, L) slots of `utterance_slots`."""
    B, H, T, d = q.shape
    if isinstance(ls, Tensor):
        pos, used, slot = utterance_slots(ls, T)  # (B, M, L), (B, M, L), (B, T)
        M, L = pos.shape[1:]
        flat = pos.flatten(1)  # (B, M L)
        keys = kv.gather(1, flat).view(B, M, L) & used  # (B, M, L) slots holding an allowed key

        def cells(t: Tensor) -> Tensor:  # (B, H, T, d) -> (B, H, M, L, d)
            return _take_frames(t, flat).view(B, H, M, L, d)

        def frames(out: Tensor) -> Tensor:  # (B, H, M, L, d) -> (B, H, T, d)
            return _take_frames(out.reshape(B, H, M * L, d), slot)

    else:
        keys = _blocks(kv, ls, 1)  # (B, n, l)

        def cells(t: Tensor) -> Tensor:  # (B, H, T, d) -> (B, H, n, l, d)
            return _blocks(t, ls)

        def frames(out: Tensor) -> Tensor:  # (B, H, n, l, d) -> (B, H, T, d)
            return out.reshape(B, H, -1, d)[:, :, :T]

    def grid(t: Tensor) -> Tensor:  # rows attend within themselves
        return cells(t).transpose(2, 3) if by_class else cells(t)

    keys = keys.transpose(1, 2) if by_class else keys  # (B, rows, cols)
    eye = torch.eye(keys.shape[2], dtype=torch.bool, device=q.device)
    allowed = keys[:, None, :, None, :] | eye  # (B, 1, rows, cols, cols)
    bias = eye.to(q.dtype) * SELF_PENALTY
    out = _attend(grid(q), grid(k), grid(v), allowed, bias, p)  # (B, H, rows, cols, d)
    return frames(out.transpose(2, 3) if by_class else out)


def block_windows(t: Tensor, ls: int, dim: int) -> Tensor:
    """Keys of each query block in the band kernels, its previous, own and next l frames along
    `dim` (zero outside): (..., T, ...) -> (..., n, 3l, ...); position w of block b is frame
    (b - 1) l + w."""
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
    """|i - j| <= l. q, k, v (B, H, T, d), kv (B, T) allowed keys -> (B, H, T, d); strides ls
    (B,): blocks of L >= every l (`patterns.stride_bounds`), each radius masked inside."""
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
    return _grid_kernel(q, k, v, kv, ls, p, by_class=True)


def block_kernel(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, ls: Stride, p: float = 0.0) -> Tensor:
    """floor(i / l) = floor(j / l). q, k, v (B, H, T, d), kv (B, T) -> (B, H, T, d)."""
    return _grid_kernel(q, k, v, kv, ls, p, by_class=False)


def summary_columns(T: int, ls: Stride, c: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The summary keys j mod l >= l - min(c, l), clamped into [0, T): positions (1 or B, N)
    (B: per-utterance strides, N from `patterns.stride_bounds`), and whether each is real."""
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
    probs = F.dropout(probs, p) if p else probs
    return probs[..., :-1] @ vs + probs[..., -1:] * v

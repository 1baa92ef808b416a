"""The random synthesizers' table kernels: windows of a logit table and row-chunked softmax(R) V
with recomputed weights, and the reused memory of the table's gradient (`synthesizer.py`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.base import masked_softmax
from speechattn.attention.kernels.memory import NUMPY_DTYPES, lazy_zeros, numpy_backed

_CHUNK = 1 << 21  # elements of one (rows, T) block of weights in TableAttention


def weighted_values(w: Tensor, v: Tensor) -> Tensor:
    """w (G, h, T, T) @ v (B, h, T, d_k) -> (B, h, T, d_k) in v's dtype; G = 1 or B (1: one
    (h, T, T) x (h, T, B d_k) product)."""
    B, h, T, d = v.shape
    w = w.to(v.dtype)
    if w.shape[0] == B:
        return w @ v
    vb = v.permute(1, 2, 0, 3).reshape(h, T, B * d)  # (h, T, B d_k)
    return (w[0] @ vb).view(h, T, B, d).permute(2, 0, 1, 3)


def _window(r: Tensor, o: int, s: int, e: int, T: int) -> Tensor:
    """Rows [o + s, o + e) and columns [o, o + T) of r (n, n), zero-padded past n (syn_fixed's
    "end" head): (e - s, T)."""
    n = r.shape[-1]
    w = r[o + s : min(o + e, n), o : min(o + T, n)]
    if w.shape == (e - s, T):
        return w  # a view, the usual case
    return F.pad(w, (0, T - w.shape[1], 0, (e - s) - w.shape[0]))


class GradientMemory:
    """Memory for a logit table's gradient (CPU), reused from step to step: fresh memory of the
    table's size (0.8 GB at l_max = 4096) costs page faults and compaction every step. Last
    step's array is handed out again, zeroed, once numpy's reference count shows nothing (no
    `.grad`) refers to it; windows under a quarter of the table take lazily zeroed memory.
    Copies and pickles start without memory.
    """

    def __init__(self) -> None:
        self.array: np.ndarray | None = None

    def take(self, table: Tensor, T: int) -> Tensor:
        """A zero tensor like table (h, n, n), for its gradient from T x T windows."""
        n = table.shape[-1]
        if not numpy_backed(table.dtype, table.device) or 4 * T * T < n * n:
            return lazy_zeros(tuple(table.shape), table.dtype, table.device)  # pages on touch
        shape, dtype = tuple(table.shape), NUMPY_DTYPES[table.dtype]
        # two references: self.array and getrefcount's argument; any more are a gradient
        if (
            self.array is None
            or self.array.shape != shape
            or self.array.dtype != dtype
            or sys.getrefcount(self.array) > 2
        ):
            self.array = np.zeros(shape, dtype=dtype)
            return torch.from_numpy(self.array)
        return torch.from_numpy(self.array).zero_()

    def __deepcopy__(self, memo: dict) -> GradientMemory:
        return GradientMemory()

    def __getstate__(self) -> dict:
        return {"array": None}


class TableWindows(torch.autograd.Function):
    """Each head's T x T window of a logit table: table (h, n, n), offsets (G, h) int ->
    (G, h, T, T), head i of group g at rows and columns [o, o + T), o = offsets[g, i]. The
    backward adds each window into one gradient (`GradientMemory`), not h zero-filled ones as
    autograd's slicing would. CPU eager only (offsets read on the host).
    """

    @staticmethod
    def forward(ctx, table: Tensor, offsets: Tensor, T: int, memory: GradientMemory) -> Tensor:
        ctx.save_for_backward(table, offsets)
        ctx.memory = memory
        return torch.stack(
            [
                torch.stack([_window(table[i], o, 0, T, T) for i, o in enumerate(offs)])
                for offs in offsets.tolist()
            ]
        )

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        table, offsets = ctx.saved_tensors
        n, T = table.shape[-1], grad.shape[-1]
        g_table = ctx.memory.take(table, T)
        # numpy adds the windows on one thread: page faults from two threads were much slower
        dst, src = g_table, grad
        if numpy_backed(g_table.dtype, g_table.device):
            dst, src = g_table.numpy(), grad.numpy()
        for g, offs in enumerate(offsets.tolist()):
            for i, o in enumerate(offs):
                c = min(T, n - o)  # rows/columns of the window inside the table
                dst[i, o : o + c, o : o + c] += src[g, i, :c, :c]
        return g_table, None, None, None


class TableAttention(torch.autograd.Function):
    """Y = softmax(R sliced to T x T, over valid keys) V in row chunks: table (h, n, n), offsets
    (G, h) as in `TableWindows`, v (B, h, T, d_k), kv (B, T) allowed keys -> (B, h, T, d_k).
    The backward recomputes each chunk's weights (G = 1: written straight into the table
    gradient). CPU eager only, in the table's dtype with autocast off (under autocast v
    arrives in half precision, the logits stay float32); outputs in v's dtype.
    """

    @staticmethod
    def _chunks(table: Tensor, offsets: Tensor, kv: Tensor) -> Iterator[tuple]:
        """(batch slice, head i, offset o, rows s:e, weights (nb | 1, C, T)) of every chunk of
        rows of every head and group (G = 1: one group for the batch)."""
        B, T = kv.shape
        chunk = max(1, _CHUNK // T)  # rows per block: one head, (chunk, T) weights
        offs = offsets.tolist()
        groups = [(slice(b, b + 1), o) for b, o in enumerate(offs)]
        if len(offs) == 1:
            groups = [(slice(0, B), offs[0])]
        for bs, group in groups:
            keys = kv[bs, None, :]  # (nb, 1, T)
            every = bool(keys.all())
            for i, o in enumerate(group):
                for s in range(0, T, chunk):
                    e = min(s + chunk, T)
                    logits = _window(table[i], o, s, e, T)[None]  # (1, C, T)
                    p = torch.softmax(logits, dim=-1) if every else masked_softmax(logits, keys)
                    yield bs, i, o, s, e, p

    @staticmethod
    def forward(
        ctx, table: Tensor, offsets: Tensor, v: Tensor, kv: Tensor, memory: GradientMemory
    ) -> Tensor:
        ctx.v_dtype, ctx.memory = v.dtype, memory
        with torch.autocast(v.device.type, enabled=False):
            v = v.to(table.dtype)
            out = v.new_empty(v.shape)
            for bs, i, _, s, e, p in TableAttention._chunks(table, offsets, kv):
                out[bs, i, s:e] = p @ v[bs, i]
        ctx.save_for_backward(table, offsets, v, kv, out)
        return out.to(ctx.v_dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None, None, None]:
        table, offsets, v, kv, out = ctx.saved_tensors
        T, n = v.shape[2], table.shape[-1]
        write_once = offsets.shape[0] == 1  # each table entry receives one block's gradient
        g_table = ctx.memory.take(table, T) if ctx.needs_input_grad[0] else None
        g_v = torch.zeros_like(v)
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.to(table.dtype)
            for bs, i, o, s, e, p in TableAttention._chunks(table, offsets, kv):
                vi, go = v[bs, i], grad[bs, i, s:e]  # (nb, T, d_k), (nb, C, d_k)
                g_v[bs, i].baddbmm_(p.transpose(-1, -2).expand(go.shape[0], -1, -1), go)
                if g_table is None:
                    continue
                delta = (go * out[bs, i, s:e]).sum(-1, keepdim=True)  # (nb, C, 1)
                r, c = min(e, n - o), min(T, n - o)
                dst = g_table[i, o + s : o + r, o : o + c]
                if write_once and go.shape[0] == 1 and dst.shape == (e - s, T):
                    # dL/dlogits = p * (go v^T - delta), written straight into the gradient
                    torch.addmm(delta[0], go[0], vi[0].T, beta=-1, out=dst).mul_(p[0])
                    continue
                g_logits = torch.baddbmm(delta, go, vi.transpose(-1, -2), beta=-1).mul_(p)
                g_logits = g_logits[0] if g_logits.shape[0] == 1 else g_logits.sum(0)  # (C, T)
                if r > s:
                    dst += g_logits[: r - s, :c]
        return g_table, None, g_v.to(ctx.v_dtype), None, None

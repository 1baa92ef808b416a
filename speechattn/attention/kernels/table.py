"""The random synthesizers' table kernels: windows of a logit table and row-chunked softmax(R) V
with recomputed weights, and the reused memory of the table's gradient (`synthesizer.py`)."""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.base import masked_softmax
from speechattn.attention.kernels.memory import NUMPY_DTYPES, lazy_zeros, numpy_backed

_CHUNK = 1 << 21  # elements of one (h, rows, T) block of weights in TableAttention


def weighted_values(w: Tensor, v: Tensor) -> Tensor:
    """w (G, h, T, T) @ v (B, h, T, d_k) -> (B, h, T, d_k), with G = 1 or B.

    G = 1 runs as one (h, T, T) x (h, T, B d_k) product rather than broadcasting w to B
    copies. The weights are cast to v's dtype (under autocast, v is half precision).
    """
    B, h, T, d = v.shape
    w = w.to(v.dtype)
    if w.shape[0] == B:
        return w @ v
    vb = v.permute(1, 2, 0, 3).reshape(h, T, B * d)  # (h, T, B d_k)
    return (w[0] @ vb).view(h, T, B, d).permute(2, 0, 1, 3)


def _window(r: Tensor, o: int, s: int, e: int, T: int) -> Tensor:
    """Rows [o + s, o + e) and columns [o, o + T) of r (n, n), zero-padded past n: (e - s, T).

    Only the "end" head of syn_fixed on a padded utterance reaches past n, and only at padded
    rows and columns (masked keys, zeroed queries).
    """
    n = r.shape[-1]
    w = r[o + s : min(o + e, n), o : min(o + T, n)]
    if w.shape == (e - s, T):
        return w  # a view, the usual case
    return F.pad(w, (0, T - w.shape[1], 0, (e - s) - w.shape[0]))


class GradientMemory:
    """Memory for a logit table's gradient (CPU), reused from step to step.

    The gradient has the table's size, h l_max^2 (0.8 GB at l_max = 4096), and fresh memory
    costs page faults on first touch, plus compaction when the OS assembles 2 MiB pages: at
    T close to l_max a step with fresh memory is markedly slower than with reused memory.

    `take` hands last step's array out again, zeroed, once nothing refers to it any more
    (numpy's reference count of the array: every tensor, view or storage on it holds one,
    so a gradient still in `.grad`, e.g. while accumulating, is never overwritten). Steps
    whose windows cover less than a quarter of the table take fresh lazily zeroed memory
    instead: zeroing all of it would cost more than the pages their windows touch.
    Copies and pickles of the module start without memory.
    """

    def __init__(self) -> None:
        self.array: np.ndarray | None = None

    def take(self, table: Tensor, T: int) -> Tensor:
        """A zero tensor of table's shape, dtype and device, for its gradient from (up to
        G) T x T windows of each (h, n, n) head."""
        n = table.shape[-1]
        if not numpy_backed(table.dtype, table.device) or 4 * T * T < n * n:
            return table_gradient(table)
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


def table_gradient(table: Tensor) -> Tensor:
    """A zero tensor of table's shape, dtype and device, for its gradient from T x T windows,
    in lazily zeroed memory (`lazy_zeros`): a step pays for the pages of its windows only,
    not for zeroing the whole table as torch.zeros would."""
    return lazy_zeros(tuple(table.shape), table.dtype, table.device)


class TableWindows(torch.autograd.Function):
    """Each head's T x T window of a logit table: table (h, n, n), offsets (G, h) int ->
    (G, h, T, T); head i of group g reads rows and columns [o, o + T), o = offsets[g, i];
    memory (`GradientMemory`) gives the gradient's memory.

    Autograd's own slicing would build one zero-filled (h, n, n) gradient per head and add
    them up (h full-table passes per step); this backward fills one gradient and adds each
    window into it. CPU eager only (it reads the offsets on the host): no autocast-sensitive op
    inside, the windows keep the table's dtype.
    """

    @staticmethod
    def forward(ctx, table: Tensor, offsets: Tensor, T: int, memory: GradientMemory) -> Tensor:
        ctx.save_for_backward(table, offsets)
        ctx.memory = memory
        return torch.stack(
            [torch.stack([_window(table[i], o, 0, T, T) for i, o in enumerate(offs)])
             for offs in offsets.tolist()]
        )  # fmt: skip

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        table, offsets = ctx.saved_tensors
        n, T = table.shape[-1], grad.shape[-1]
        g_table = ctx.memory.take(table, T)
        # On CPU the windows are added by numpy, on one thread: the first write to each page of
        # the lazily zeroed gradient faults, and faults from two threads at once were many
        # times slower than from one.
        dst, src = (
            (g_table.numpy(), grad.numpy())
            if numpy_backed(g_table.dtype, g_table.device)
            else (g_table, grad)
        )
        for g, offs in enumerate(offsets.tolist()):
            for i, o in enumerate(offs):
                c = min(T, n - o)  # rows/columns of the window inside the table
                dst[i, o : o + c, o : o + c] += src[g, i, :c, :c]
        return g_table, None, None, None


class TableAttention(torch.autograd.Function):
    """Y = softmax(R sliced to T x T, over valid keys) V, in row chunks.

    table (h, n, n) logits; offsets (G, h) int: head i of group g reads rows and columns
    [o, o + T) with o = offsets[g, i]; G = 1 (one slice for the whole batch) or G = B (one per
    utterance); v (B, h, T, d_k); kv (B, T) allowed keys; memory (`GradientMemory`) gives the
    table gradient's memory. Returns (B, h, T, d_k).
    The backward pass recomputes each chunk's weights; with G = 1 it writes the gradient of
    each head's slice straight into the table gradient. CPU eager only (offsets and padding are
    read on the host); autocast is handled explicitly: switched off inside, v and the gradient
    cast to the table's dtype, the outputs back to v's.
    """

    @staticmethod
    def _groups(offsets: Tensor, B: int) -> list[tuple[slice, list[int]]]:
        """[(batch slice, per-head offsets)]."""
        offs = offsets.tolist()
        return (
            [(slice(0, B), offs[0])]
            if len(offs) == 1
            else [(slice(b, b + 1), o) for b, o in enumerate(offs)]
        )

    @staticmethod
    def _probs(r: Tensor, o: int, s: int, e: int, kv: Tensor) -> Tensor:
        """Weights of rows [s, e) of one head's table r (n, n) read at offset o: (nb | 1, C, T)."""
        T = kv.shape[-1]
        logits = _window(r, o, s, e, T)[None]  # (1, C, T)
        if bool(kv.all()):
            return torch.softmax(logits, dim=-1)
        return masked_softmax(logits, kv[:, None, :])

    @staticmethod
    def forward(
        ctx, table: Tensor, offsets: Tensor, v: Tensor, kv: Tensor, memory: GradientMemory
    ) -> Tensor:
        # Computed in the table's dtype with autocast off: under autocast v arrives in half
        # precision while the logits (a parameter) stay float32.
        ctx.v_dtype, ctx.memory = v.dtype, memory
        with torch.autocast(v.device.type, enabled=False):
            out = TableAttention._forward(ctx, table, offsets, v.to(table.dtype), kv)
        return out.to(ctx.v_dtype)

    @staticmethod
    def _forward(ctx, table: Tensor, offsets: Tensor, v: Tensor, kv: Tensor) -> Tensor:
        B, h, T, _ = v.shape
        chunk = max(1, _CHUNK // T)  # rows per block: one head, (chunk, T) weights
        out = v.new_empty(v.shape)
        for bs, offs in TableAttention._groups(offsets, B):
            for i, o in enumerate(offs):
                for s in range(0, T, chunk):
                    e = min(s + chunk, T)
                    p = TableAttention._probs(table[i], o, s, e, kv[bs])  # (nb | 1, C, T)
                    out[bs, i, s:e] = p @ v[bs, i]
        ctx.save_for_backward(table, offsets, v, kv, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None, None, None]:
        table = ctx.saved_tensors[0]
        with torch.autocast(grad.device.type, enabled=False):
            g_table, g_v = TableAttention._backward(ctx, grad.to(table.dtype))
        return g_table, None, g_v.to(ctx.v_dtype), None, None

    @staticmethod
    def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor]:
        table, offsets, v, kv, out = ctx.saved_tensors
        B, h, T, d = v.shape
        n = table.shape[-1]
        chunk = max(1, _CHUNK // T)
        groups = TableAttention._groups(offsets, B)
        write_once = len(groups) == 1  # each table entry receives one block's gradient
        g_table = ctx.memory.take(table, T) if ctx.needs_input_grad[0] else None
        g_v = torch.zeros_like(v)
        for bs, offs in groups:
            for i, o in enumerate(offs):
                vi, gvi = v[bs, i], g_v[bs, i]  # (nb, T, d_k)
                for s in range(0, T, chunk):
                    e = min(s + chunk, T)
                    p = TableAttention._probs(table[i], o, s, e, kv[bs])  # (nb | 1, C, T)
                    go = grad[bs, i, s:e]  # (nb, C, d_k)
                    gvi.baddbmm_(p.transpose(-1, -2).expand(go.shape[0], -1, -1), go)
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
                    if r <= s:
                        continue
                    dst += g_logits[: r - s, :c]
        return g_table, g_v

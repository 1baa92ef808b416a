"""Softmax attention of each query over its own selected keys on the CPU (`sparse_topk.py`'s
forward and backward), compiled with numba: one pass per query row where the CSR products
take several over (N T kk) index arrays; the backward scatters dK and dV head by head (one
thread per head, so no two add to one key). Sums in the inputs' dtype, reassociated in lanes.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange
from torch import Tensor

from speechattn.attention.kernels.topk_cpu import cpu_kernel

_FAST = {"reassoc", "contract"}  # vectorised sums; no assumption about infinities or NaN


@cpu_kernel(fastmath=_FAST)
def _forward(q, k, v, col, allowed, scale, penalty, lowest, out, p):
    """q, k, v (R, d), col (R, kk) key rows (n T + j), allowed (R, kk), out (R, d) and the
    weights p (R, kk) written. Disallowed entries weigh 0; a row without any allowed entry
    weighs its kk keys alike (`base.masked_softmax`). scale, penalty and lowest (the dtype's
    most negative value) are scalars of q's dtype, so that nothing widens."""
    R, kk = col.shape
    d = q.shape[1]
    zero = lowest - lowest
    for r in prange(R):
        top = lowest
        for t in range(kk):
            c = col[r, t]
            s = lowest
            if allowed[r, t]:
                acc = zero
                for e in range(d):
                    acc += q[r, e] * k[c, e]
                s = acc * scale
                if c == r:
                    s += penalty
            p[r, t] = s
            top = max(top, s)
        total = zero
        for t in range(kk):
            p[r, t] = np.exp(p[r, t] - top)
            total += p[r, t]
        for e in range(d):
            out[r, e] = 0
        for t in range(kk):
            w = p[r, t] / total
            p[r, t] = w
            c = col[r, t]
            for e in range(d):
                out[r, e] += w * v[c, e]


@cpu_kernel(fastmath=_FAST)
def _backward(grad, q, k, v, out, p, col, scale, T, g_q, g_k, g_v):
    """dL/dq, dL/dk, dL/dv (R, d) written from dL/dout grad (R, d); one head (T rows, whose
    keys are its own T rows) per task. scale is a scalar of q's dtype."""
    R, kk = col.shape
    d = q.shape[1]
    zero = scale - scale
    for n in prange(R // T):
        for r in range(n * T, (n + 1) * T):
            for e in range(d):
                g_k[r, e] = 0
                g_v[r, e] = 0
        for r in range(n * T, (n + 1) * T):
            delta = zero
            for e in range(d):
                delta += grad[r, e] * out[r, e]
                g_q[r, e] = 0
            for t in range(kk):
                c = col[r, t]
                g_p = zero
                for e in range(d):
                    g_p += grad[r, e] * v[c, e]
                g_s = (g_p - delta) * p[r, t] * scale
                w = p[r, t]
                for e in range(d):
                    g_q[r, e] += g_s * k[c, e]
                    g_k[c, e] += g_s * q[r, e]
                    g_v[c, e] += w * grad[r, e]


def topk_attention_cpu(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor, scale: float, penalty: float
) -> tuple[Tensor, Tensor, Tensor]:
    """`sparse_topk._topk_attention` on the CPU: q, k, v (N, T, d) float32/64, idx, allowed
    (N, T, kk) -> out (N, T, d), weights p (N T kk,), key rows col (N T kk,)."""
    N, T, d = q.shape
    kk = idx.shape[-1]
    col = (idx + torch.arange(N).view(N, 1, 1) * T).reshape(N * T, kk).contiguous()
    out, p = q.new_empty(N * T, d), q.new_empty(N * T, kk)
    if N * T:
        rows = [t.reshape(N * T, -1).contiguous().numpy() for t in (q, k, v, allowed)]
        dtype = rows[0].dtype.type
        scalars = dtype(scale), dtype(penalty), dtype(np.finfo(dtype).min)
        _forward(*rows[:3], col.numpy(), rows[3], *scalars, out.numpy(), p.numpy())
    return out.view(N, T, d), p.view(-1), col.view(-1)


def topk_attention_backward_cpu(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, p: Tensor, col: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """`sparse_topk._topk_attention_backward` on the CPU: dL/dq, dL/dk, dL/dv (N, T, d)."""
    N, T, d = q.shape
    grads = [q.new_empty(N * T, d) for _ in range(3)]
    if N * T:
        rows = [t.reshape(N * T, d).contiguous().numpy() for t in (grad, q, k, v, out)]
        kk = col.shape[0] // (N * T)
        _backward(
            *rows, p.view(N * T, kk).numpy(), col.view(N * T, kk).numpy(),
            rows[0].dtype.type(scale), T,
            *(g.numpy() for g in grads),
        )  # fmt: skip
    return tuple(g.view(N, T, d) for g in grads)

"""Softmax attention of each query over its own selected keys on the CPU (`sparse_topk.py`'s
custom ops), compiled with numba: one pass per query row; the backward scatters dK and dV one
head per thread, so no two threads add to one key. Sums in the inputs' dtype, in lanes.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from speechattn.attention.kernels.topk_cpu import cpu_kernel

_FAST = {"reassoc", "contract"}  # vectorised sums; no assumption about infinities or NaN


@cpu_kernel(fastmath=_FAST)
def forward(q, k, v, col, allowed, scale, penalty, lowest, out, p):
    """q, k, v (R, d), col (R, kk) key rows (n T + j), allowed (R, kk) -> out (R, d) and weights
    p (R, kk) written, as `base.masked_softmax` (a row with no allowed entry weighs its keys
    alike); scale, penalty and lowest (the dtype's minimum) are scalars of q's dtype."""
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
def backward(grad, q, k, v, out, p, col, scale, T, g_q, g_k, g_v):
    """dL/dq, dL/dk, dL/dv (R, d) written from dL/dout grad (R, d), one head (T rows, keys among
    them) per task; scale a scalar of q's dtype."""
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

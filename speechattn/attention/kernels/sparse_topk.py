"""Softmax attention of each query over its own selected keys, a custom op with its own
backward (`lsh.py`): sparse (CSR) products on GPUs, numba kernels on the CPU
(`sparse_topk_cpu.py`)."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor

from speechattn.attention.base import SELF_PENALTY, masked_softmax, widen
from speechattn.attention.kernels import sparse_topk_cpu


def _use_cpu_kernel(t: Tensor) -> bool:
    """Whether the CPU kernels run (tests replace this to run the CSR version on the CPU)."""
    return t.device.type == "cpu"


def _csr(crow: Tensor, col: Tensor, values: Tensor) -> Tensor:
    """A square CSR matrix of len(crow) - 1 rows."""
    n = crow.shape[0] - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(crow, col, values, (n, n))


# A custom op: torch.compile keeps it as one opaque call (sparse tensors cannot be traced), its
# fake implementations give shapes on fake/meta tensors.
@torch.library.custom_op("speechattn::topk_attention", mutates_args=())
def _topk_attention(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (N, T, d) float32/64, idx (N, T, kk), allowed (N, T, kk) -> out (N, T, d),
    weights p (N T kk,) and CSR columns col (N T kk,) (saved for the backward)."""
    N, T, d = q.shape
    kk = idx.shape[-1]
    if _use_cpu_kernel(q):
        col = (idx + torch.arange(N).view(N, 1, 1) * T).reshape(N * T, kk).contiguous()
        out, p = q.new_empty(N * T, d), q.new_empty(N * T, kk)
        if N * T:
            rows = [t.reshape(N * T, -1).contiguous().numpy() for t in (q, k, v, allowed)]
            dtype = rows[0].dtype.type  # scalars of q's dtype, so that nothing widens
            scalars = dtype(scale), dtype(SELF_PENALTY), dtype(np.finfo(dtype).min)
            sparse_topk_cpu.forward(
                *rows[:3], col.numpy(), rows[3], *scalars, out.numpy(), p.numpy()
            )
        return out.view(N, T, d), p.view(-1), col.view(-1)
    with torch.autocast(q.device.type, enabled=False):  # sparse kernels: float32/64 only
        idx, order = idx.sort(dim=-1)  # CSR columns in increasing order
        allowed = allowed.gather(-1, order)
        crow = torch.arange(N * T + 1, device=q.device) * kk
        col = (idx + torch.arange(N, device=q.device).view(N, 1, 1) * T).view(-1)  # (N T kk)
        q, k, v = q.reshape(N * T, d), k.reshape(N * T, d), v.reshape(N * T, d)
        pattern = _csr(crow, col, q.new_ones(col.shape))
        sc = torch.sparse.sampled_addmm(pattern, q, k.T, beta=0.0, alpha=scale).values()
        own = idx == torch.arange(T, device=q.device)[:, None]  # (N, T, kk)
        sc = sc.view(N, T, kk) + own.to(q.dtype) * SELF_PENALTY
        p = masked_softmax(sc, allowed).reshape(-1)  # (N T kk)
        out = _csr(crow, col, p) @ v  # (N T, d)
    return out.view(N, T, d), p, col


@_topk_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor, scale: float):
    n = idx.numel()
    return torch.empty_like(q), q.new_empty(n), idx.new_empty(n, dtype=torch.long)


def key_pointers(col: Tensor, by_key: Tensor, n: int) -> Tensor:
    """Row pointers (n + 1,) of the transposed pattern (entries with key < j, j = 0..n) from the
    keys col (nnz,) and their stable order by_key, sized by n, not by data."""
    return torch.searchsorted(col[by_key], torch.arange(n + 1, device=col.device))


@torch.library.custom_op("speechattn::topk_attention_backward", mutates_args=())
def _topk_attention_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    p: Tensor,
    col: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dL/dq, dL/dk, dL/dv (N, T, d) of `_topk_attention` from dL/dout (N, T, d)."""
    shape = q.shape
    N, T, d = shape
    kk = col.shape[0] // max(1, N * T)
    if _use_cpu_kernel(q):
        grads = [q.new_empty(N * T, d) for _ in range(3)]
        if N * T:
            rows = [t.reshape(N * T, d).contiguous().numpy() for t in (grad, q, k, v, out)]
            sparse_topk_cpu.backward(
                *rows,
                p.view(N * T, kk).numpy(),
                col.view(N * T, kk).numpy(),
                rows[0].dtype.type(scale),
                T,
                *(g.numpy() for g in grads),
            )
        return tuple(g.view(shape) for g in grads)
    with torch.autocast(q.device.type, enabled=False):
        grad, q, k, v, out = (t.reshape(N * T, d) for t in (grad, q, k, v, out))
        crow = torch.arange(N * T + 1, device=q.device) * kk
        pattern = _csr(crow, col, torch.ones_like(p))
        g_p = torch.sparse.sampled_addmm(pattern, grad, v.T, beta=0.0).values().view(-1, kk)
        delta = (grad * out).sum(-1, keepdim=True)  # (N T, 1)
        g_s = ((g_p - delta) * p.view(-1, kk) * scale).view(-1)  # dL/dscores
        # the transpose: entries by key, a key's queries in increasing order (stable sort)
        by_key = col.to(torch.int32).argsort(stable=True)  # int32 sorts faster than int64
        crow_t = key_pointers(col, by_key, N * T)
        query = by_key // kk  # the row (query) of each entry, in key order
        g_q = _csr(crow, col, g_s) @ k
        g_k = _csr(crow_t, query, g_s[by_key]) @ q
        g_v = _csr(crow_t, query, p[by_key]) @ grad
    return g_q.view(shape), g_k.view(shape), g_v.view(shape)


@_topk_attention_backward.register_fake
def _(grad, q, k, v, out, p, col, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _topk_attention_setup(ctx, inputs, output) -> None:
    ctx.scale = inputs[-1]
    ctx.save_for_backward(*inputs[:3], *output)  # q, k, v, out, p, col


def _topk_attention_grad(ctx, grad: Tensor, _p: Tensor | None, _col: Tensor | None):
    q, k, v, out, p, col = ctx.saved_tensors
    g_q, g_k, g_v = _topk_attention_backward(grad.contiguous(), q, k, v, out, p, col, ctx.scale)
    return g_q, g_k, g_v, None, None, None


_topk_attention.register_autograd(_topk_attention_grad, setup_context=_topk_attention_setup)


def sparse_topk_attention(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor, scale: float
) -> Tensor:
    """Softmax attention of each query over its own selected keys: q, k, v (N, T, d_k), idx
    (N, T, kk) distinct key positions per row, allowed (N, T, kk) bool -> (N, T, d_k) in q's
    dtype, computed in float32/64 with autocast off. The heads' patterns lie along the diagonal
    of one (N T, N T) CSR matrix (docs/attention.md, LSH): memory O(T kk + T d_k), never T x T.
    """
    out, _, _ = _topk_attention(widen(q), widen(k), widen(v), idx, allowed, scale)
    return out.to(q.dtype)

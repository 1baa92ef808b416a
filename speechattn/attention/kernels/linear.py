"""Linear attention's kernel with a hand-written backward (`linear.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def phi(x: Tensor) -> Tensor:
    """The feature map elu(x) + 1: positive, x + 1 above 0 and exp(x) below."""
    return F.elu(x) + 1


class LinearKernel(torch.autograd.Function):
    """Heads phi(Q) S / (phi(Q) z) from q, k, v (B, h, T, d_k) -> (B, h, T, d_k); keep
    (B, 1, T, 1) 1 at valid keys or None; drop (B, h, T, 1) the dropout column mask or None.
    Hand-written (autograd's ~25 small steps cost as much as `full` at short T): [S, z] =
    phi(K)^T [V, 1] in one product, phi' = min(phi, 1) from the saved features. Float32/64
    only: CUDA autocast casts inputs (`custom_fwd`), callers widen.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, drop: Tensor | None
    ) -> Tensor:
        fq, fk = phi(q), phi(k)  # (B, h, T, d_k)
        if keep is not None:
            fk = fk * keep  # zero at padded keys, and so is phi's derivative read from it
        v1 = F.pad(v, (0, 1), value=1.0)  # [V, 1] (B, h, T, d_k + 1)
        state = (fk if drop is None else fk * drop).transpose(-1, -2) @ v1  # [S, z]
        if drop is not None:
            state[..., -1] = fk.sum(-2)  # the normaliser keeps every key
        num_den = fq @ state  # (B, h, T, d_k + 1)
        den = num_den[..., -1:].clamp_min(torch.finfo(q.dtype).tiny)  # 0 / 0 only on underflow
        out = num_den[..., :-1] / den
        ctx.save_for_backward(fq, fk, v1, state, out, den, drop)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        fq, fk, v1, state, out, den, drop = ctx.saved_tensors
        g_num = grad / den  # (B, h, T, d_k)
        g_den = -(g_num * out).sum(-1, keepdim=True)  # (B, h, T, 1)
        g_num_den = torch.cat([g_num, g_den], dim=-1)  # (B, h, T, d_k + 1)
        g_fq = g_num_den @ state.transpose(-1, -2)  # (B, h, T, d_k)
        g_state = fq.transpose(-1, -2) @ g_num_den  # (B, h, d_k, d_k + 1): [dS, dz]
        g_s, g_z = g_state[..., :-1], g_state[..., -1:].transpose(-1, -2)
        v = v1[..., :-1]
        g_v = (fk if drop is None else fk * drop) @ g_s
        g_fk = v @ g_s.transpose(-1, -2)  # (B, h, T, d_k)
        if drop is not None:
            g_fk.mul_(drop)
        g_fk += g_z
        return g_fq.mul_(fq.clamp(max=1)), g_fk.mul_(fk.clamp(max=1)), g_v, None, None

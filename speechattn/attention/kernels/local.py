"""LDSA's window kernel: a weighted sum over c shifted copies of the values (`ldsa.py`)."""

from __future__ import annotations

import torch
from torch import Tensor

from speechattn.attention.base import widen


class LocalWeightedSum(torch.autograd.Function):
    """out_t = sum_j w_{t,j} v_{t+j}: w (B, h, T, c), v (B, h, T + c - 1, d_k) -> (B, h, T, d_k),
    c shifted multiply-adds without autograd's c zero-filled slice gradients, summed in
    float32 at least (half precision would round over c = 15 terms); the output in the
    promoted input dtype (CUDA autocast casts the inputs, `custom_fwd`).
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, w: Tensor, v: Tensor) -> Tensor:
        T, c = w.shape[-2:]
        wf, vf = widen(w), widen(v)
        # In place in eager (no new tensor per term); out of place under torch.compile, where
        # dynamo (torch 2.11) silently drops this Function's gradients when its forward
        # returns a tensor it accumulated in place (the compiled kernel fuses the sum anyway).
        compiling = torch.compiler.is_compiling()
        out = wf[..., 0, None] * vf[:, :, :T]
        for j in range(1, c):
            term = wf[..., j, None], vf[:, :, j : j + T]
            out = torch.addcmul(out, *term) if compiling else out.addcmul_(*term)
        ctx.save_for_backward(w, v)
        dtype = torch.promote_types(w.dtype, v.dtype)
        # no `.to` when it would return `out` itself: dynamo drops the gradients then too
        return out if out.dtype == dtype else out.to(dtype)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        w, v = ctx.saved_tensors
        T, c = w.shape[-2:]
        wf, vf, gf = widen(w), widen(v), widen(grad)
        gw = gv = None
        if ctx.needs_input_grad[0]:
            gw = torch.stack([(gf * vf[:, :, j : j + T]).sum(-1) for j in range(c)], dim=-1)
            gw = gw.to(w.dtype)
        if ctx.needs_input_grad[1]:
            gv = torch.zeros_like(vf)
            for j in range(c):
                gv[:, :, j : j + T].addcmul_(wf[..., j, None], gf)
            gv = gv.to(v.dtype)
        return gw, gv

"""The adaptive span's CPU kernels: attention under an additive mask that depends on the spans,
with the spans' gradient as one more reduction of the scores' gradient (`adaptive_span.py`)."""

from __future__ import annotations

import torch

from speechattn.attention.base import widen

# CPU flash attention with its log-sum-exp (public SDPA returns only the output)
flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class FlashThenUnfused(torch.autograd.Function):
    """Attention under an additive mask that depends on the spans z, on CPU: CPU flash forward
    (in q's dtype, the mask a constant: it has no mask gradient), unfused backward from its
    log-sum-exp (float32 or float64, autocast off) with dL/dz_h = sum dS * d mask / dz_h; with
    a reach X, query blocks of `backward_block` frames against the keys within reach only.
    """

    backward_block = 128  # queries per block of the backward (the fastest in the benchmark)
    backward_scores = 1 << 22  # scores (batch x heads x block x keys) per pass of the backward

    @staticmethod
    def forward(ctx, q, k, v, z, mask, mask_dz, reach, keys_reversed):  # noqa: D102
        """q, k, v (B, h, L, d); z (h,); mask, mask_dz (its z-derivative) (B or 1, h, L, Lk);
        reach: X or None (all pairs); keys_reversed: key j stored at Lk - 1 - j."""
        out, log_sum_exp = flash_cpu(q, k, v, attn_mask=mask)
        ctx.save_for_backward(q, k, v, out, log_sum_exp, mask, mask_dz)
        ctx.span_dtype, ctx.reach, ctx.keys_reversed = z.dtype, reach, keys_reversed
        return out

    @staticmethod
    @torch.autocast("cpu", enabled=False)  # widened below: keep float32
    def backward(ctx, d_out):  # noqa: D102
        q, k, v, out, log_sum_exp, mask, mask_dz = ctx.saved_tensors
        q_, k_, v_, out_, d_out_ = (widen(t) for t in (q, k, v, out, d_out))  # (B, h, ., d)
        wide = q_.dtype  # half precision: in float32
        lse = log_sum_exp.to(wide)[..., None]  # (B, h, L, 1)
        row = (d_out_ * out_).sum(-1, keepdim=True)  # dO . O
        d_q, d_k, d_v = torch.zeros_like(q_), torch.zeros_like(k_), torch.zeros_like(v_)
        d_z = torch.zeros(q.shape[1], dtype=wide, device=q.device)
        N, h, L, d = q.shape
        Lk, X, scale_ = k.shape[-2], ctx.reach, d**-0.5
        step = L if X is None else FlashThenUnfused.backward_block
        # about `backward_scores` scores per pass: small temporaries, their memory reused (fresh
        # memory costs page faults)
        per_pass = max(
            1, FlashThenUnfused.backward_scores // (h * step * min(Lk, step + 2 * (X or Lk)))
        )
        for n in range(0, N, per_pass):
            batch = slice(n, n + per_pass)
            q_n, k_n, v_n, o_n, lse_n, row_n = (t[batch] for t in (q_, k_, v_, d_out_, lse, row))
            dq_n, dk_n, dv_n = d_q[batch], d_k[batch], d_v[batch]  # views, written in place
            mask_n = mask if mask.shape[0] == 1 else mask[batch]  # a mask may serve the batch
            dz_n = mask_dz if mask_dz.shape[0] == 1 else mask_dz[batch]
            for a in range(0, L, step):
                b = min(L, a + step)
                c, e = (0, Lk) if X is None else (max(0, a - X), min(Lk, b + X))  # within reach
                if ctx.keys_reversed:
                    c, e = Lk - e, Lk - c
                qa, oa = q_n[..., a:b, :], o_n[..., a:b, :]
                ka, va = k_n[..., c:e, :], v_n[..., c:e, :]
                # the probabilities again, from flash's log-sum-exp: exp(q k^T scale + mask - lse)
                probs = (qa @ ka.mT).mul_(scale_).add_(mask_n[..., a:b, c:e])
                probs = probs.sub_(lse_n[..., a:b, :]).exp_()  # (n', h, b - a, e - c)
                dv_n[..., c:e, :] += probs.mT @ oa
                d_scores = (oa @ va.mT).sub_(row_n[..., a:b, :]).mul_(probs)  # P (dP - dO . O)
                d_z += (d_scores * dz_n[..., a:b, c:e]).sum((0, 2, 3))
                dq_n[..., a:b, :] = d_scores @ ka
                dk_n[..., c:e, :] += d_scores.mT @ qa
        d_q, d_k = d_q.mul_(scale_).to(q.dtype), d_k.mul_(scale_).to(k.dtype)
        return d_q, d_k, d_v.to(v.dtype), d_z.to(ctx.span_dtype), None, None, None, None


class UnfusedSavedWeights(torch.autograd.Function):
    """`FlashThenUnfused` for short sequences: unfused, keeping the weights P (N, h, L, Lk) for
    the backward (as fast as SDPA there, recomputing P is not); float32/64, autocast off."""

    @staticmethod
    def forward(ctx, q, k, v, z, mask, mask_dz):  # noqa: D102
        """q, k, v (N, h, L | Lk, d); z (h,); mask, mask_dz (N or 1, h, L, Lk)."""
        N, h, L, d = q.shape
        Lk = k.shape[-2]
        q_, k_, v_ = (widen(t).reshape(N * h, -1, d) for t in (q, k, v))
        bias = mask.to(q_.dtype).expand(N, h, L, Lk).reshape(N * h, L, Lk)
        with torch.autocast(q.device.type, enabled=False):
            weights = torch.baddbmm(bias, q_, k_.mT, alpha=d**-0.5).softmax(-1)  # (N h, L, Lk)
            out = weights @ v_  # (N h, L, d)
        ctx.save_for_backward(q_, k_, v_, out, weights, mask_dz)
        ctx.dtypes = q.dtype, k.dtype, v.dtype, z.dtype
        return out.view(N, h, L, d).to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):  # noqa: D102
        q_, k_, v_, out, weights, mask_dz = ctx.saved_tensors
        N, h, L, d = d_out.shape
        d_out_ = d_out.to(out.dtype).reshape(N * h, L, d)
        with torch.autocast(d_out.device.type, enabled=False):
            row = (d_out_ * out).sum(-1, keepdim=True)  # dO . O
            d_v = weights.mT @ d_out_
            d_scores = torch.baddbmm(row.neg_(), d_out_, v_.mT).mul_(weights)  # P (dP - dO.O)
            d_z = (d_scores.view(N, h, L, -1) * mask_dz).sum((0, 2, 3))
            d_q = (d_scores @ k_).mul_(d**-0.5)
            d_k = (d_scores.mT @ q_).mul_(d**-0.5)
        grads = (g.view(N, h, -1, d) for g in (d_q, d_k, d_v))
        d_q, d_k, d_v = (g.to(dtype) for g, dtype in zip(grads, ctx.dtypes, strict=False))
        return d_q, d_k, d_v, d_z.to(ctx.dtypes[3]), None, None

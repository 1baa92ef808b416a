"""GPU suite (`pytest -m gpu`; skipped without CUDA): every kernel of every variant on the
device, under bf16 autocast, against its float32 dense reference (outputs and gradients,
the tolerances of test_precision.py). Sizes are the study's per-head shape (d_k = 64)."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import GRAD_TOLERANCE, OUTPUT_TOLERANCE, force_path, kernels, rel_error

from speechattn.attention import build, registry

pytestmark = pytest.mark.gpu
DIM, HEADS, LENGTHS = 256, 4, [300, 181]


def _pass(attn, x, pad, w, dense: bool):
    attn.zero_grad()
    xi = x.clone().requires_grad_(True)
    if dense:
        y = attn.dense_reference(xi, pad)[0]
    else:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = attn(xi, pad)
    (y.float() * w).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in attn.named_parameters() if p.grad is not None}
    return y.detach(), xi.grad, grads


@pytest.mark.parametrize(("name", "kernel"), kernels())
def test_bf16_kernel_matches_float32_dense_reference(name, kernel, gpu_device, monkeypatch):
    force_path(monkeypatch, kernel)
    torch.manual_seed(0)
    options = {"max_len": 512} if "max_len" in registry.options(name) else {}
    attn = build(name, DIM, HEADS, **options).to(gpu_device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(LENGTHS), max(LENGTHS), DIM, generator=g).to(gpu_device)
    pad = (torch.arange(max(LENGTHS))[None] >= torch.tensor(LENGTHS)[:, None]).to(gpu_device)
    w = torch.randn(x.shape, generator=g).to(gpu_device)
    if hasattr(attn, "select"):  # the reference uses the keys the bf16 run selected
        chosen = {}
        select = attn.select
        monkeypatch.setattr(attn, "select", lambda q, k, v: chosen.setdefault("i", select(q, k, v)))
        monkeypatch.setattr(
            attn,
            "selection_dense",
            lambda q, k, v: torch.zeros(q.shape[:-1] + (q.shape[-2],), dtype=torch.bool,
                                        device=q.device).scatter(-1, chosen["i"], True),
        )  # fmt: skip
    y, gx, gp = _pass(attn, x, pad, w, dense=False)
    y_ref, gx_ref, gp_ref = _pass(attn, x, pad, w, dense=True)
    assert y.dtype == torch.bfloat16 and (y[pad] == 0).all()
    assert rel_error(y, y_ref) < OUTPUT_TOLERANCE[torch.bfloat16]
    assert rel_error(gx, gx_ref) < GRAD_TOLERANCE[torch.bfloat16]
    assert gp.keys() == gp_ref.keys() and gp
    for n in gp:
        assert rel_error(gp[n], gp_ref[n]) < GRAD_TOLERANCE[torch.bfloat16], n

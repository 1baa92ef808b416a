"""GPU suite (`pytest -m gpu`; skipped without CUDA): every kernel of every variant on the
device (FlexAttention included), under bf16 autocast, against its float32 dense reference (outputs and gradients,
the tolerances of test_precision.py). Sizes are the study's per-head shape (d_k = 64)."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import (
    GRAD_TOLERANCE,
    OUTPUT_TOLERANCE,
    device_kernels,
    hold_selection,
    rel_error,
    train_pass,
    use_kernel,
)

from speechattn.attention import build, registry

pytestmark = pytest.mark.gpu
DIM, HEADS, LENGTHS = 256, 4, [300, 181]


@pytest.mark.parametrize(("name", "kernel"), device_kernels())
def test_bf16_kernel_matches_float32_dense_reference(name, kernel, gpu_device, monkeypatch):
    torch.manual_seed(0)
    options = {"max_len": 512} if "max_len" in registry.options(name) else {}
    attn = build(name, DIM, HEADS, **options).to(gpu_device)
    use_kernel(attn, kernel, monkeypatch)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(LENGTHS), max(LENGTHS), DIM, generator=g).to(gpu_device)
    pad = (torch.arange(max(LENGTHS))[None] >= torch.tensor(LENGTHS)[:, None]).to(gpu_device)
    w = torch.randn(x.shape, generator=g).to(gpu_device)
    hold_selection(attn, monkeypatch)  # the reference uses the bf16 run's keys
    y, gx, gp = train_pass(attn, x, pad, w, torch.bfloat16)
    y_ref, gx_ref, gp_ref = train_pass(attn, x, pad, w, dense=True)
    assert y.dtype == torch.bfloat16 and (y[pad] == 0).all()
    assert rel_error(y, y_ref) < OUTPUT_TOLERANCE[torch.bfloat16]
    assert rel_error(gx, gx_ref) < GRAD_TOLERANCE[torch.bfloat16]
    assert gp.keys() == gp_ref.keys() and gp
    for n in gp:
        assert rel_error(gp[n], gp_ref[n]) < GRAD_TOLERANCE[torch.bfloat16], n

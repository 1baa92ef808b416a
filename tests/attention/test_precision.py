"""Every registered variant trains under bf16 and fp16 autocast, on each of its kernels.

CPU autocast follows the dtype rules of the GPU path (`trainer=gpu` is bf16-mixed), so these
tests cover what a GPU run meets: projections in half precision, softmax and the variants'
own kernels in whatever they choose. A new variant is covered when it registers; one with
several kernels (a short- and a long-sequence one, `short_path_max_t`, or other names,
`kernel_names`) is run on each, but Flex (no backward on CPU).

Stated tolerance, relative (Frobenius) error against the same float32 module: outputs 1e-2
(bf16) / 2e-3 (fp16); gradients of inputs and parameters 8e-2 / 3e-3, except for the variants
whose logits are learned projections of each frame (`LEARNED_LOGITS`), whose fp16 gradients
reach 2e-2 as T grows (measured 1.6e-2 at D 768, T 300-500: docs/attention.md); at T = 20
and T = 512. LSH variants are compared with their float32 top-k
selection held fixed: a sign bit of a half-precision query may flip, which changes the keys,
not the kernels' accuracy.
"""

from __future__ import annotations

import pytest
import torch
from _attention_testing import (
    DIM,
    GRAD_TOLERANCE,
    HEADS,
    OUTPUT_TOLERANCE,
    SMALL_OPTIONS,
    batch,
    device_kernels,
    hold_selection,
    rel_error,
    train_pass,
    use_kernel,
)

from speechattn.attention import FusedAttentionPool, available, build, get

NAMES = available()
TOLERANCE = OUTPUT_TOLERANCE
DTYPES = list(TOLERANCE)
LENGTHS = [20, 13, 1]
# the variants whose logits are learned per frame: their fp16 gradients grow with T
LEARNED_LOGITS = {"syn_dense", "syn_dense_mh", "ldsa"}
LEARNED_GRAD_TOLERANCE = {torch.bfloat16: 8e-2, torch.float16: 2e-2}


@pytest.mark.parametrize("T", [20, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(("name", "path"), [c for c in device_kernels() if c[1] != "flex"])
def test_trains_under_autocast_close_to_float32(name, path, dtype, T, monkeypatch):
    torch.manual_seed(0)
    options = SMALL_OPTIONS.get(name, {})
    if "max_len" in options:
        options = {**options, "max_len": max(options["max_len"], T)}
    attn = build(name, DIM, HEADS, **options)
    use_kernel(attn, path, monkeypatch)
    hold_selection(attn, monkeypatch)  # the float32 top-k (module docstring)
    grad_tolerance = (LEARNED_GRAD_TOLERANCE if name in LEARNED_LOGITS else GRAD_TOLERANCE)[dtype]
    x, pad = batch([T, T * 2 // 3, 1])
    x = x.float()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    y32, gx32, gp32 = train_pass(attn, x, pad, w)
    y, gx, gp = train_pass(attn, x, pad, w, dtype)
    assert y.dtype == dtype and torch.isfinite(y).all() and (y[pad] == 0).all()
    assert rel_error(y, y32) < TOLERANCE[dtype]
    assert rel_error(gx, gx32) < grad_tolerance
    assert gp.keys() == gp32.keys() and gp
    for n in gp:
        assert torch.isfinite(gp[n]).all() and gp[n].dtype == gp32[n].dtype, n
        assert rel_error(gp[n], gp32[n]) < grad_tolerance, n


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_weights_under_autocast(name, dtype):
    """need_weights (attention maps, head analysis) also runs under autocast."""
    torch.manual_seed(0)
    attn = build(name, DIM, HEADS, **SMALL_OPTIONS.get(name, {})).eval()
    x, pad = batch(LENGTHS)
    with torch.autocast("cpu", dtype=dtype):
        y, weights = attn(x.float(), pad, need_weights=True)
    rows = weights.float().sum(-1).transpose(1, 2)[~pad]  # (valid frames, h)
    torch.testing.assert_close(rows, torch.ones_like(rows), rtol=0, atol=TOLERANCE[dtype])
    assert torch.isfinite(y).all() and (y[pad] == 0).all()


@pytest.mark.parametrize("name", [n for n in NAMES if hasattr(get(n), "select")])
def test_lsh_selection_ignores_autocast(name):
    """Codes and top-k run in float32 with autocast off: the same queries select the same
    keys inside and outside autocast (fp16 autocast used to fail in the match product)."""
    torch.manual_seed(0)
    attn = build(name, DIM, HEADS, **SMALL_OPTIONS[name])
    x, pad = batch([300, 210])  # above every short-path limit: the grouped top-k too
    q, k, _ = attn._qkv(x.float())
    want = attn.select(q.bfloat16().float(), k.bfloat16().float(), ~pad)
    for dtype in DTYPES:
        with torch.autocast("cpu", dtype=dtype):
            got = attn.select(q.bfloat16(), k.bfloat16(), ~pad)
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_fused_attention_pool_under_autocast(dtype):
    torch.manual_seed(0)
    pool = FusedAttentionPool(DIM, out_dim=8, qk_dim=16)
    x, pad = batch(LENGTHS)
    x = x.float()
    ref, alpha_ref = pool(x, pad, need_weights=True)
    xi = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype):
        y, alpha = pool(xi, pad, need_weights=True)
    y.float().sum().backward()
    assert torch.isfinite(xi.grad).all() and pool.f_q.weight.grad is not None
    assert rel_error(y, ref) < TOLERANCE[dtype] and rel_error(alpha, alpha_ref) < TOLERANCE[dtype]
    assert (alpha[pad] == 0).all()

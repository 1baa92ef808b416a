"""Contract tests run on every registered variant (a new variant is tested on registration)."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import DIM, HEADS, batch, force_path, kernels, make

from speechattn.attention import available

NAMES = available()
LENGTHS = [17, 9, 1, 13]  # mixed lengths, one utterance of a single frame


def _loss_weights(y: torch.Tensor) -> torch.Tensor:
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)


@pytest.mark.parametrize(("name", "kernel"), kernels())
def test_efficient_path_equals_dense_reference(name, kernel, monkeypatch):
    """forward and gradients (inputs and parameters) of both paths agree in float64, for each
    kernel of a variant that has a short- and a long-sequence one."""
    force_path(monkeypatch, kernel)
    attn = make(name)
    x, pad = batch(LENGTHS)
    w = _loss_weights(x)
    grads = []
    for path in ("fast", "dense"):
        xi = x.clone().requires_grad_(True)
        xi_mask = torch.ones(HEADS, dtype=torch.float64, requires_grad=True)
        attn.zero_grad()
        y = (
            attn(xi, pad, head_mask=xi_mask)
            if path == "fast"
            else attn.dense_reference(xi, pad, xi_mask)[0]
        )
        (y * w).sum().backward()
        params = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}
        grads.append((y.detach(), xi.grad, xi_mask.grad, params))
    (y0, gx0, gm0, gp0), (y1, gx1, gm1, gp1) = grads
    torch.testing.assert_close(y0, y1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gx0, gx1, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(gm0, gm1, rtol=1e-9, atol=1e-10)
    assert gp0.keys() == gp1.keys() and gp0
    for n in gp0:
        torch.testing.assert_close(gp0[n], gp1[n], rtol=1e-9, atol=1e-10, msg=f"grad of {n}")


@pytest.mark.parametrize("name", NAMES)
def test_padding_never_leaks(name):
    attn = make(name)
    x, pad = batch(LENGTHS)
    y = attn(x, pad)
    x2 = x.clone()
    x2[pad] = 100 * torch.randn(int(pad.sum()), DIM, dtype=x.dtype)
    y2 = attn(x2, pad)
    torch.testing.assert_close(y[~pad], y2[~pad], rtol=0, atol=1e-12)
    assert (y[pad] == 0).all() and (y2[pad] == 0).all()
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", NAMES)
def test_batch_equals_each_sample_alone(name):
    attn = make(name)
    x, pad = batch(LENGTHS)
    y = attn(x, pad)
    for b, n in enumerate(LENGTHS):
        alone = attn(x[b : b + 1, :n])
        torch.testing.assert_close(y[b : b + 1, :n], alone, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("name", NAMES)
def test_single_frame_and_all_but_one_padded_are_finite(name):
    attn = make(name)
    for x, pad in (batch([1]), batch([1, 1], T=6)):
        x.requires_grad_(True)
        y = attn(x, pad)
        y.sum().backward()
        assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
        assert (y[pad] == 0).all()
        y_ref, w = attn(x, pad, need_weights=True)
        torch.testing.assert_close(y, y_ref)
        assert torch.isfinite(w).all()


@pytest.mark.parametrize("name", NAMES)
def test_zero_head_mask_removes_that_head(name):
    """xi_h = 0 equals zeroing head h's slice of the merged heads before W^O."""
    attn = make(name)
    x, pad = batch(LENGTHS)
    seen = {}
    hook = attn.out_proj.register_forward_hook(lambda m, inp, out: seen.update(merged=inp[0]))
    attn(x, pad)
    hook.remove()
    dk = DIM // HEADS
    for h in range(HEADS):
        merged = seen["merged"].clone()
        merged[..., h * dk : (h + 1) * dk] = 0
        expected = attn.out_proj(merged).masked_fill(pad[..., None], 0)
        xi = torch.ones(HEADS, dtype=torch.float64)
        xi[h] = 0
        torch.testing.assert_close(attn(x, pad, head_mask=xi), expected, rtol=1e-10, atol=1e-12)
    xi = torch.ones(HEADS, dtype=torch.float64, requires_grad=True)
    attn(x, pad, head_mask=xi).pow(2).sum().backward()
    assert xi.grad is not None and torch.isfinite(xi.grad).all() and (xi.grad != 0).any()


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_distributions_over_valid_keys(name):
    attn = make(name)
    x, pad = batch(LENGTHS)
    y, w = attn(x, pad, need_weights=True)
    B, T = pad.shape
    assert w.shape == (B, HEADS, T, T)
    torch.testing.assert_close(y, attn(x, pad))
    rows = w.sum(-1).transpose(1, 2)  # (B, T, h)
    torch.testing.assert_close(rows[~pad], torch.ones_like(rows[~pad]))
    assert (rows[pad] == 0).all()
    assert (w * pad[:, None, None, :]).abs().max() == 0  # padded keys get no weight
    assert (w >= 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_metadata(name):
    attn = make(name)
    assert attn.num_heads == HEADS and attn.name == name and attn.paper
    for cost in (attn.complexity_training, attn.complexity_inference):  # each variant states it
        assert cost.startswith("O(") and "T" in cost, cost
    for T in (1, 16, 1000):
        k = attn.keys_attended(T)
        assert isinstance(k, float) and 0 <= k <= T


@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_raise_with_shapes(name):
    attn = make(name)
    x, pad = batch([5, 3])
    with pytest.raises(ValueError, match="expected x"):
        attn(x[..., :-1])
    with pytest.raises(ValueError, match="padding_mask"):
        attn(x, pad[:, :-1])
    with pytest.raises(ValueError, match="head_mask"):
        attn(x, pad, head_mask=torch.ones(HEADS + 1, dtype=x.dtype))


@pytest.mark.parametrize("name", NAMES)
def test_float32_train_mode_runs(name):
    """The default dtype, training mode with attention dropout, backward works."""
    from _attention_testing import SMALL_OPTIONS

    from speechattn.attention import build

    attn = build(name, DIM, HEADS, dropout=0.1, **SMALL_OPTIONS.get(name, {})).train()
    x, pad = batch([12, 7])
    y = attn(x.float(), pad)
    y.sum().backward()
    assert torch.isfinite(y).all() and (y[pad] == 0).all()

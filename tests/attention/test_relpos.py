"""relpos: the relative shift and the (i, j) <-> distance i - j convention."""

from __future__ import annotations

import math

import pytest
import torch
from _attention_testing import DIM, HEADS, batch, make

from speechattn.attention.relpos import relative_shift


@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_relative_shift_picks_distance_i_minus_j(T):
    scores = torch.randn(2, 3, T, 2 * T - 1, dtype=torch.float64)
    got = relative_shift(scores)
    for i in range(T):
        for j in range(T):
            # column n holds distance T - 1 - n, so distance i - j sits at n = T - 1 - i + j
            torch.testing.assert_close(got[..., i, j], scores[..., i, T - 1 - i + j])


def test_weights_follow_the_transformer_xl_formula():
    """Scores written pair by pair from the paper's formula, sinusoids of i - j included."""
    attn = make("relpos")
    x, pad = batch([7, 4])
    _, weights = attn(x, pad, need_weights=True)
    q, k, _ = attn._qkv(x)  # (B, h, T, d_k)
    B, h, T, dk = q.shape
    u, v = attn.pos_bias_u, attn.pos_bias_v
    expected = torch.zeros(B, h, T, T, dtype=x.dtype)
    for i in range(T):
        for j in range(T):
            m = i - j
            r = torch.zeros(DIM, dtype=x.dtype)
            for c in range(0, DIM, 2):
                r[c] = math.sin(m / 10000 ** (c / DIM))
                r[c + 1] = math.cos(m / 10000 ** (c / DIM))
            p = attn.pos_proj(r).view(h, dk)  # (h, d_k)
            s = ((q[:, :, i] + u) * k[:, :, j]).sum(-1) + ((q[:, :, i] + v) * p).sum(-1)
            expected[:, :, i, j] = s / math.sqrt(dk)
    expected = expected.masked_fill(pad[:, None, None, :], float("-inf")).softmax(-1)
    expected = expected * (~pad)[:, None, :, None]
    torch.testing.assert_close(weights, expected, rtol=1e-10, atol=1e-12)


def test_position_term_depends_on_distance_only():
    """Shifting the input in time (same content, later start) shifts the weights with it."""
    attn = make("relpos")
    x, _ = batch([6])
    later = torch.cat([torch.zeros(1, 3, DIM, dtype=x.dtype), x], dim=1)  # 3 padded frames first
    pad = torch.tensor([[True] * 3 + [False] * 6])
    _, w = attn(x, need_weights=True)
    _, w_later = attn(later, pad, need_weights=True)
    torch.testing.assert_close(w_later[:, :, 3:, 3:], w, rtol=1e-10, atol=1e-12)
    assert w.shape == (1, HEADS, 6, 6)


def test_biases_are_learned():
    attn = make("relpos")
    x, pad = batch([5, 3])
    attn(x, pad).sum().backward()
    assert attn.pos_bias_u.grad.abs().sum() > 0 and attn.pos_bias_v.grad.abs().sum() > 0
    assert attn.pos_proj.bias is None

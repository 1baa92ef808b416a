"""FusedAttentionPool (docs/attention.md, "FusedAttention pooling")."""

from __future__ import annotations

import math

import pytest
import torch

from speechattn.attention import FusedAttentionPool
from speechattn.attention.pooling import to_patches


def _data(lengths, T=9, D=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), T, D, generator=g, dtype=torch.float64)
    pad = torch.arange(T)[None] >= torch.tensor(lengths)[:, None]
    return x, pad


@pytest.mark.parametrize(("scale", "size"), [(None, 5), ("value", 5), ("key", 4)])
def test_equals_mean_over_queries_of_ordinary_attention(scale, size):
    """Scores are divided by sqrt(d) = sqrt(5), the size of V (the default), or by
    sqrt(u) = sqrt(4), the size of Q and K, with scale="key"."""
    torch.manual_seed(0)
    options = {} if scale is None else {"scale": scale}
    pool = FusedAttentionPool(6, out_dim=5, qk_dim=4, **options).double()
    x, pad = _data([9, 4, 1])
    y, alpha = pool(x, pad, need_weights=True)
    for b, n in enumerate([9, 4, 1]):
        xb = x[b, :n]
        q, k, v = pool.f_q(xb), pool.f_k(xb), pool.f_v(xb)
        att = torch.softmax(q @ k.T / math.sqrt(size), dim=-1)  # (n queries, n keys)
        torch.testing.assert_close(y[b], (att @ v).mean(0))
        torch.testing.assert_close(alpha[b, :n], att.mean(0))
    assert (alpha[pad] == 0).all()
    torch.testing.assert_close(alpha.sum(-1), torch.ones(3, dtype=torch.float64))


def test_unknown_scale_is_an_error():
    with pytest.raises(ValueError, match="scale must be 'value'.*or 'key'.*got 'query'"):
        FusedAttentionPool(6, scale="query")


def test_padding_invariance_and_gradients():
    pool = FusedAttentionPool(6).double()
    x, pad = _data([9, 3])
    x.requires_grad_(True)
    y = pool(x, pad)
    x2 = x.detach().clone()
    x2[pad] = 1e3
    torch.testing.assert_close(pool(x2, pad), y)
    y.sum().backward()
    assert (x.grad[pad] == 0).all() and torch.isfinite(x.grad).all()


def test_collection_form_equals_stacked_tensor():
    pool = FusedAttentionPool(3 * 4).double()
    items = [torch.randn(2, 3, 4, dtype=torch.float64) for _ in range(5)]
    torch.testing.assert_close(pool(items), pool(torch.stack(items, 1)))


def test_patch_form_cuts_non_overlapping_patches():
    x = torch.arange(2 * 3 * 4 * 6, dtype=torch.float64).view(2, 3, 4, 6)
    tok = to_patches(x, (2, 3))
    assert tok.shape == (2, 4, 3 * 2 * 3)
    torch.testing.assert_close(tok[1, 3], x[1, :, 2:4, 3:6].reshape(-1))
    pool = FusedAttentionPool(18, patch=(2, 3), g_v=lambda y: y.view(-1, 3, 2, 3)).double()
    assert pool(x).shape == (2, 3, 2, 3)


def test_pluggable_functions():
    proj = torch.nn.Linear(6, 6).double()
    pool = FusedAttentionPool(
        f_q=proj, f_k=proj, f_v=torch.nn.Identity(), fuse=lambda w, qv: w[..., 0]
    ).double()
    x, pad = _data([9])
    y, alpha = pool(x, pad, need_weights=True)
    s = proj(x[0]) @ proj(x[0])[0] / math.sqrt(6)  # keys against the first query
    torch.testing.assert_close(alpha[0], torch.softmax(s, 0))
    torch.testing.assert_close(y[0], alpha[0] @ x[0])

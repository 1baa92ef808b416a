"""The FlexAttention kernel of the sparse variants (`kernel="flex"`, flex.py).

Torch 2.11 has Flex's backward on CUDA only, so here its forward runs eagerly on CPU against
the dense reference; the GPU suite (test_gpu_kernels.py) trains through it in bf16."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import HEADS, batch, make

from speechattn.attention import build, flex
from speechattn.attention.base import key_mask


def _flex_heads(attn, x, pad):
    """The Flex kernel's per-head outputs (B, h, T, d_k), utterance by utterance (each with
    its own l), zero past each length."""
    valid = ~pad
    q, k, v = attn.shared_qkv(x.masked_fill(pad[..., None], 0))
    out = torch.zeros_like(q)
    for b, ls in enumerate(attn.strides(valid)):
        key, mask_mod = attn.flex_mask(ls)
        n = int(valid[b].sum())
        one = flex.pattern_attention(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], key_mask(valid)[b : b + 1], mask_mod, key
        )
        out[b, :, :n] = one[0, :, :n]
    return out


# eager Flex on CPU is the unfused reference implementation, which says so
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("sparse_strided", {}),
        ("sparse_strided", {"stride": 3}),
        ("sparse_fixed", {}),
        ("sparse_fixed", {"block": 4, "summary": 2}),
    ],
)
def test_flex_kernel_equals_dense_reference(name, options):
    attn = make(name, kernel="flex", **options)
    x, pad = batch([150, 97, 1], T=150)  # past one 128 bucket; l differs per utterance
    with torch.no_grad():
        heads = _flex_heads(attn, x, pad)
        ref_heads, _ = attn.attend_dense(x.masked_fill(pad[..., None], 0), ~pad)
    for b, n in enumerate([150, 97, 1]):
        torch.testing.assert_close(heads[b, :, :n], ref_heads[b, :, :n], rtol=1e-10, atol=1e-10)


def test_flex_block_mask_is_built_once_per_pattern_and_bucket(monkeypatch):
    attn = make("sparse_strided", kernel="flex", stride=4)
    x, pad = batch([100, 120])
    flex._BLOCK_MASKS.clear()
    built = []
    create = flex._flex_module().create_block_mask
    monkeypatch.setattr(
        flex._flex_module(),
        "create_block_mask",
        lambda *a, **kw: built.append(a) or create(*a, **kw),
    )
    with torch.no_grad():
        _flex_heads(attn, x, pad)
        _flex_heads(attn, x[:, :110], pad[:, :110])  # same 128 bucket: cached
        assert len(built) == 1
        _flex_heads(attn, *batch([200], T=200))  # next bucket
    assert len(built) == 2 and built[1][3] == 256


def test_flex_option_falls_back_to_sdpa_off_cuda():
    """On CPU (no Flex backward) the option keeps the SDPA sub-problems: same outputs and
    gradients as the default kernel."""
    x, pad = batch([20, 12])
    outs = []
    for kernel in ("sdpa", "flex"):
        attn = make("sparse_strided", kernel=kernel).train()
        xi = x.clone().requires_grad_(True)
        y = attn(xi, pad)
        y.sum().backward()
        outs.append((y, xi.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not flex.use_flex(x, training=True, dropout=0.0)


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match=r"kernel must be one of \('sdpa', 'flex'\), got 'triton'"):
        build("sparse_fixed", 32, HEADS, kernel="triton")

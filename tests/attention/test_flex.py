"""The FlexAttention kernel of the sparse variants (`kernel="flex"`, flex.py).

Torch 2.11 has Flex's backward on CUDA only, so here its forward runs on CPU against the
dense reference (eagerly), and compiled with a counting backend to show that it compiles
once per (batch size, length bucket) whatever the strides; its BlockMask is checked to cover
every block the dense patterns need; fake CUDA traces it forward and backward
(tests/fakecuda); the GPU suite (test_gpu_kernels.py) trains through it in bf16."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import HEADS, batch, make

from speechattn.attention import build, flex
from speechattn.attention.base import key_mask


def _flex_heads(attn, x, pad, backend=None):
    """The Flex kernel's per-head outputs (B, h, T, d_k), one call for the batch with each
    utterance's own l, as CUDA runs it."""
    valid = ~pad
    B, T = valid.shape
    q, k, v = attn._qkv(x.masked_fill(pad[..., None], 0))
    ls = torch.tensor(attn.strides(valid))  # (B,)
    key, pattern, envelope = attn.flex_mask(ls, B, T, q.device)
    return flex.pattern_attention(q, k, v, key_mask(valid), pattern, envelope, key, backend)


# eager Flex on CPU is the unfused reference implementation, which says so
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("sparse_strided", {}),
        ("sparse_strided", {"stride": 3}),
        ("sparse_fixed", {}),
        ("sparse_fixed", {"block": 4, "summary": 2}),
        ("sparse_fixed", {"summary": 11}),  # c clipped to l per utterance (l = 12, 10, 1)
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
    attn = make("sparse_strided", kernel="flex")
    flex._BLOCK_MASKS.clear()
    built = []
    create = flex.flex_module.create_block_mask
    monkeypatch.setattr(
        flex.flex_module,
        "create_block_mask",
        lambda *a, **kw: built.append(a) or create(*a, **kw),
    )
    with torch.no_grad():
        _flex_heads(attn, *batch([100, 120]))  # l = 10, 11
        _flex_heads(attn, *batch([110, 30], T=110))  # other strides, same 128 bucket: cached
        assert len(built) == 1
        _flex_heads(attn, *batch([200]))  # next bucket
    assert len(built) == 2 and built[1][3] == 256


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sparse_strided", "sparse_fixed"])
def test_compiled_flex_compiles_once_per_bucket_whatever_the_strides(name):
    """The strides are tensors the score_mod captures, not constants: batches of one bucket
    with other strides and lengths reuse the compiled kernel; the next bucket compiles once
    more, past a recompile limit of 1 (the call raises dynamo's limit to MAX_COMPILES)."""
    compiled = []

    def counting(gm, example_inputs):  # noqa: ANN001, ANN202 - a torch.compile backend
        compiled.append(gm)
        return gm.forward

    torch._dynamo.reset()
    attn = make(name, kernel="flex")
    cases = [([150, 97, 1], 150), ([200, 180, 60], 200), ([256, 131, 129], 256)]
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        for lengths, T in cases:  # l = (12, 10, 1), (14, 13, 8), (16, 11, 11): bucket 256
            x, pad = batch(lengths, T=T)
            torch.testing.assert_close(
                _flex_heads(attn, x, pad, counting), _flex_heads(attn, x, pad), rtol=0, atol=0
            )
        assert len(compiled) == 1
        _flex_heads(attn, *batch([300, 20, 77]), backend=counting)  # bucket 384
    assert len(compiled) == 2


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


def test_unknown_kernel_is_refused_and_the_old_name_is_the_blocked_kernel():
    message = r"kernel must be one of \('auto', 'blocked', 'masked', 'flex'\), got 'triton'"
    with pytest.raises(ValueError, match=message):
        build("sparse_fixed", 32, HEADS, kernel="triton")
    assert build("sparse_fixed", 32, HEADS, kernel="sdpa").config.kernel == "blocked"


def _needed_blocks(allowed: torch.Tensor) -> torch.Tensor:
    """(B, h, T, T) bool, T a multiple of 128 -> (h, T/128, T/128): the 128 x 128 blocks in
    which some utterance of the batch has an allowed key."""
    B, h, T, _ = allowed.shape
    n = T // flex.BUCKET
    return allowed.view(B, h, n, flex.BUCKET, n, flex.BUCKET).any(dim=(0, 3, 5))


# name, options, bucket, (blocks of the first half's heads, of the second half's)
COVERAGE = [
    ("sparse_strided", {}, 512, (10, 16)),  # l <= 23: band of 3 blocks; residue: all blocks
    ("sparse_strided", {}, 1024, (22, 64)),
    ("sparse_fixed", {}, 1024, (22, 64)),  # own block of l <= 32; summary columns: all
    ("sparse_strided", {"stride": 200}, 512, (14, 16)),  # the exact pattern of a fixed l
    ("sparse_fixed", {"block": 200, "summary": 3}, 1024, (26, 43)),
]


@pytest.mark.parametrize(("name", "options", "T", "blocks"), COVERAGE)
def test_block_mask_covers_exactly_the_blocks_the_patterns_need(name, options, T, blocks):
    """Every 128 x 128 block holding a key of the dense reference's pattern is in the
    BlockMask, for a batch of lengths (and default strides) across the bucket; the envelope
    adds no other block: the bucket's longest utterance needs every block of it. The residue
    and summary heads need all blocks (a block of 128 keys holds every residue class, and a
    summary column, of a stride l <= 128), so Flex skips blocks of the first half only."""
    attn = make(name, **options)
    lengths = [T, T - 1, T - 100, T // 2 + 1, T // 3, 129, 128, 40]
    valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    needed = _needed_blocks(attn.allowed_dense(valid))  # (h, n, n)
    ls = torch.tensor(attn.strides(valid))
    key, _, envelope = attn.flex_mask(ls, len(lengths), T, ls.device)
    present = flex.block_mask_for(key, envelope, HEADS, T, ls.device).to_dense()[0].bool()
    assert not (needed & ~present).any(), "a block the pattern needs is missing"
    assert torch.equal(present, needed), "the envelope adds blocks"
    hA = attn.heads_first
    assert present[:hA].sum((1, 2)).unique().tolist() == [blocks[0]]
    assert present[hA:].sum((1, 2)).unique().tolist() == [blocks[1]]


def test_block_mask_is_built_outside_compiled_regions():
    """Inside a compiled region (the whole model under torch.compile) the cache is only read:
    a missing BlockMask is built in the graph and not stored; one built eagerly is reused."""
    attn = make("sparse_strided", kernel="flex")
    x, pad = batch([150, 97, 1], T=150)

    def heads(x: torch.Tensor) -> torch.Tensor:
        return _flex_heads(attn, x, pad)

    flex._BLOCK_MASKS.clear()
    torch._dynamo.reset()
    compiled = torch.compile(heads, backend="eager", fullgraph=True)
    try:
        with torch.no_grad():
            traced = compiled(x)
            assert not flex._BLOCK_MASKS
            eager = heads(x)
            assert len(flex._BLOCK_MASKS) == 1
            torch._dynamo.reset()
            cached = compiled(x)
            assert len(flex._BLOCK_MASKS) == 1
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    torch.testing.assert_close(cached, eager, rtol=0, atol=0)

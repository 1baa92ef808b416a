"""The masked kernel (`kernels/masked.py`): sparse_*'s heads and routing's local heads as one
SDPA call per head group with the pattern as a mask. Exact against each variant's dense
reference in float64 and float32, padded and unpadded, outputs and gradients; its masks are
built without a host read and aligned so that SDPA does not copy them; compiled, one graph."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import HEADS, SMALL_OPTIONS, batch, make, rel_error

from speechattn.attention import autotune, build, patterns
from speechattn.attention.base import SELF_PENALTY
from speechattn.attention.kernels.masked import MASK_ALIGN, masked_heads, pattern_bias
from speechattn.attention.pruning import prune_heads
from speechattn.bench.syncs import SyncCounter

SPARSE = [
    ("sparse_strided", {}),
    ("sparse_strided", {"stride": 3}),
    ("sparse_fixed", {}),
    ("sparse_fixed", {"block": 4, "summary": 2}),
    ("sparse_fixed", {"summary": 11}),  # c clipped to each utterance's l
]
# mixed extents and strides, an empty utterance, a single frame; T not a multiple of 8
LENGTHS = [([17, 9, 1, 13], None), ([40, 33, 2, 0], 43), ([30, 30], None)]
# float64: the tolerances of test_variants.py; float32: a few ulps of its sums over T keys
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6}


def _pass(attn, x, pad, w, dense: bool):
    """(y, dL/dx, {parameter: gradient}) of L = sum(y * w)."""
    attn.zero_grad()
    xi = x.clone().requires_grad_(True)
    y = attn.dense_reference(xi, pad)[0] if dense else attn(xi, pad)
    (y * w).sum().backward()
    return y.detach(), xi.grad, {n: p.grad.clone() for n, p in attn.named_parameters()}


def _assert_exact(attn, x, pad, dtype) -> None:
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    (y, gx, gp), (y_ref, gx_ref, gp_ref) = (_pass(attn, x, pad, w, d) for d in (False, True))
    valid = slice(None) if pad is None else ~pad
    assert rel_error(y[valid], y_ref[valid]) < TOLERANCE[dtype]
    assert rel_error(gx, gx_ref) < TOLERANCE[dtype]
    assert gp.keys() == gp_ref.keys()
    for n in gp:
        assert rel_error(gp[n], gp_ref[n]) < TOLERANCE[dtype], n


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("lengths,T", LENGTHS)
@pytest.mark.parametrize("name,options", SPARSE)
def test_sparse_masked_kernel_equals_dense_reference(name, options, lengths, T, padded, dtype):
    attn = make(name, kernel="masked", **options).to(dtype)
    x, pad = batch(lengths, T)
    x = x.to(dtype)
    assert autotune.pick_kernel(attn, x) == "masked"
    _assert_exact(attn, x, pad if padded else None, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_routing_masked_local_heads_equal_dense_reference(padded, dtype, monkeypatch):
    attn = make("routing").to(dtype)
    monkeypatch.setattr(attn, "_forced_kernel", "masked")
    x, pad = batch([40, 33, 2], 43)
    _assert_exact(attn, x.to(dtype), pad if padded else None, dtype)


def test_masked_kernel_with_pruned_heads_and_odd_head_counts():
    """Head groups of any size, one of them empty (pruning keeps only first-half heads)."""
    torch.manual_seed(0)
    attn = build("sparse_strided", 30, 5, kernel="masked").double().eval()  # 3 + 2 heads
    x, pad = batch([20, 11])
    x = x[..., :30]
    torch.testing.assert_close(attn(x, pad), attn.dense_reference(x, pad)[0])
    prune_heads(attn, [0, 2])  # both of the first half
    assert attn.heads_first == 2
    torch.testing.assert_close(attn(x, pad), attn.dense_reference(x, pad)[0])


@pytest.mark.parametrize("T", [1, 7, 8, 43])
def test_pattern_bias_values_and_alignment(T):
    allowed = patterns.band_pattern(T, 2)  # (T, T)
    kv = torch.arange(T)[None] < torch.tensor([T, max(1, T - 3)])[:, None]  # (2, T)
    bias = pattern_bias(allowed, kv, torch.float32)
    assert bias.shape == (2, 1, T, T) and bias.dtype == torch.float32
    # rows a multiple of MASK_ALIGN elements apart: SDPA takes the mask as it is
    assert all(s % MASK_ALIGN == 0 for s in bias.stride()[:-1]) and bias.stride(-1) == 1
    eye = torch.eye(T, dtype=torch.bool)
    want = torch.full((2, T, T), float("-inf")).masked_fill(allowed & kv[:, None, :], 0.0)
    want = want.masked_fill(eye, SELF_PENALTY)  # the self key always, penalised
    assert torch.equal(bias[:, 0], want)
    assert torch.equal(pattern_bias(allowed, None, torch.bfloat16)[0, 0], want[0].bfloat16())


def test_head_groups_must_cover_the_heads():
    q = torch.randn(1, HEADS, 6, 8)
    with pytest.raises(ValueError, match="cover 3 heads, q has 4"):
        masked_heads(q, q, q, [(3, patterns.band_pattern(6, 1))], None)


@pytest.mark.parametrize(("name", "options"), [*SPARSE[:3], ("routing", {})])
def test_masked_kernel_reads_nothing_on_the_host(name, options, monkeypatch):
    """The strides, patterns and masks come from device ops: the CPU standing in for the
    device (`SyncCounter`), the kernel makes no host read, padded or not."""
    attn = make(name, **{**SMALL_OPTIONS.get(name, {}), **options})
    if name == "routing":  # its local heads only (the cluster heads' CPU tables read sizes)
        prune_heads(attn, list(range(attn.heads_local)))
    monkeypatch.setattr(attn, "_forced_kernel", "masked")
    x, pad = batch([40, 33, 2], 43)
    for valid in (None, ~pad):
        with SyncCounter() as syncs:
            attn.attend(x, valid)
        assert syncs.count == 0, syncs.reasons


def test_forced_kernel_switch_reaches_every_kernel():
    """`autotune.forced` runs each named kernel: all equal in float64."""
    attn = make("sparse_strided")
    x, pad = batch([30, 12])
    outs = {}
    for kernel in ("blocked", "masked"):
        with autotune.forced(attn, kernel):
            outs[kernel] = attn(x, pad)
    torch.testing.assert_close(outs["blocked"], outs["masked"], rtol=1e-12, atol=1e-12)

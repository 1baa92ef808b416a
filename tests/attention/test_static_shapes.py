"""The branches that CUDA and torch.compile take in sparse_*, longformer and ldsa:
shapes fixed by T and the options, no host read of device data, exact against the dense
reference, and one graph under torch.compile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from _attention_testing import DIM, HEADS, SMALL_OPTIONS, batch, make, rel_error

from speechattn.attention import build, patterns, sparse
from speechattn.attention.kernels.local import LocalWeightedSum

sys.path.insert(0, str(Path(__file__).parents[1] / "fakecuda"))
from _fake_cuda import CUDA, backward, cuda_autocast, fake_cuda  # noqa: E402

SPARSE = [
    ("sparse_strided", {}),
    ("sparse_strided", {"stride": 3}),
    ("sparse_fixed", {}),
    ("sparse_fixed", {"summary": 3}),
]
# mixed extents (strides 4, 3, 1, 1 / 6, 6, 1, 1 / 10, 8), an empty utterance, one frame
LENGTHS = [([17, 9, 1, 13], None), ([40, 33, 2, 0], 40), ([100, 57], None), ([1, 1], 6)]


def test_default_strides_on_device_equal_the_host_rule():
    n = torch.arange(0, 20000)
    assert patterns.default_strides(n).tolist() == [patterns.default_stride(int(e)) for e in n]


@pytest.mark.parametrize("T", [1, 2, 3, 7, 40, 99, 100, 101, 500, 1201])
def test_stride_bounds_hold_for_every_shorter_utterance(T):
    L, M = patterns.stride_bounds(T)
    for e in range(1, T + 1):
        ls = patterns.default_stride(e)
        assert ls <= L and -(-e // ls) <= M, (e, ls)


@pytest.mark.parametrize("lengths,T", LENGTHS)
@pytest.mark.parametrize("name,options", SPARSE)
def test_sparse_static_branch_equals_dense_reference(name, options, lengths, T, monkeypatch):
    """Per-utterance strides as a device tensor (the CUDA / compile branch), run on the CPU."""
    monkeypatch.setattr(sparse, "needs_static_shapes", lambda t: True)
    attn = make(name, **options)
    x, pad = batch(lengths, T)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    results = []
    for dense in (False, True):
        xi = x.clone().requires_grad_(True)
        y = attn.dense_reference(xi, pad)[0] if dense else attn(xi, pad)
        (y * w).sum().backward()
        results.append((y, xi.grad))
    (y, gx), (y_ref, gx_ref) = results
    assert rel_error(y, y_ref) < 1e-12 and rel_error(gx, gx_ref) < 1e-12


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("name", ["sparse_strided", "sparse_fixed"])
def test_sparse_stride_follows_the_extent_when_padding_has_holes(name, static, monkeypatch):
    """l comes from the frames up to the last valid one, on both branches."""
    monkeypatch.setattr(sparse, "needs_static_shapes", lambda t: static)
    attn = make(name)
    x, _ = batch([50, 50, 50])
    pad = torch.rand(3, 50, generator=torch.Generator().manual_seed(5)) < 0.4
    pad[:, 0] = False  # holes after each utterance's first frame (leading padding is refused)
    assert rel_error(attn(x, pad), attn.dense_reference(x, pad)[0]) < 1e-12


def test_local_weighted_sum_accumulates_in_float32():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(2, 3, 40, 15, generator=g).softmax(-1).bfloat16()
    v = torch.randn(2, 3, 54, 8, generator=g).bfloat16()
    out = LocalWeightedSum.apply(w, v)
    wide = sum(w.float()[..., j, None] * v.float()[:, :, j : j + 40] for j in range(15))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, wide.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_local_weighted_sum_under_cuda_autocast_runs_in_float32(dtype):
    with fake_cuda():
        w = torch.randn(2, 4, 10, 5, device=CUDA, dtype=dtype, requires_grad=True)
        v = torch.randn(2, 4, 14, 8, device=CUDA, dtype=dtype, requires_grad=True)
        with cuda_autocast(dtype):
            out = LocalWeightedSum.apply(w, v)
        grads = backward([out], [torch.ones_like(out)])
    assert out.dtype == torch.float32
    assert grads[w].dtype == dtype and grads[v].dtype == dtype


COMPILED = [("sparse_strided", None), ("sparse_fixed", None), ("ldsa", None)] + [
    ("longformer", "short"),
    ("longformer", "long"),
    ("sparse_fixed", "masked"),  # a kernel named by the option
]


@pytest.mark.slow
@pytest.mark.parametrize("name,path", COMPILED)
def test_one_graph_under_compile_with_eager_gradients(name, path, monkeypatch):
    """fullgraph=True (any graph break raises), padded and unpadded, through AOTAutograd (the
    graphs inductor compiles): eager's loss and gradients. Regressions caught here: ldsa's
    Function lost its gradients under dynamo; longformer's index_copy broke the backward."""
    options = dict(SMALL_OPTIONS.get(name, {}))
    if path in ("short", "long"):
        limit = 10**9 if path == "short" else 0
        monkeypatch.setattr(type(make(name)), "short_path_max_t", limit)
    elif path is not None:
        options["kernel"] = path
    torch.manual_seed(0)
    attn = build(name, DIM, HEADS, **options)
    x, pad = batch([40, 27])

    def loss(x, pad):
        return attn(x, pad).pow(2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    try:
        for mask in (None, pad):
            results = []
            for fn in (loss, compiled):
                attn.zero_grad()
                xi = x.float().requires_grad_(True)
                fn(xi, mask).backward()
                results.append([xi.grad] + [p.grad for p in attn.parameters()])
            for eager, graph in zip(*results):
                torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()

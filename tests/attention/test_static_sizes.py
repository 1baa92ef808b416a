"""LSH and routing with the sizes a GPU or torch.compile uses: fixed per length,
from shapes and options only, never read from device data. Forced here on CPU, they must give
what the CPU eager path's data-dependent sizes give, and compile without graph breaks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _attention_testing import DIM, HEADS, batch, make

from speechattn.attention import routing
from speechattn.attention.kernels import cluster, sparse_topk, topk

LSH = ["sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh"]


def _pass(attn, x, pad):
    """y and dL/dx of L = sum(y * w) through the efficient path."""
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    xi = x.clone().requires_grad_(True)
    y = attn(xi, pad)
    (y * w).sum().backward()
    return y.detach(), xi.grad


@pytest.mark.parametrize("limit", [10**9, 0], ids=["short", "long"])
@pytest.mark.parametrize("lengths", [[40, 23, 1], [40]], ids=["padded", "unpadded"])
def test_routing_static_sizes_equal_measured_ones(lengths, limit, monkeypatch):
    """Member tables W = `capacity_bound(T)` wide and `blocks_bound` query blocks per head
    (empty slots and blocks) give the same outputs and gradients as the batch's own sizes,
    and both match the float64 dense reference."""
    monkeypatch.setattr(routing.RoutingAttention, "short_path_max_t", limit)
    x, pad = batch(lengths)
    pad = pad if pad.any() else None
    measured = _pass(make("routing"), x, pad)
    monkeypatch.setattr(routing, "needs_static_shapes", lambda t: True)
    monkeypatch.setattr(cluster, "needs_static_shapes", lambda t: True)  # its kernel's too
    static = _pass(make("routing"), x, pad)
    for a, b in zip(static, measured, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    reference = make("routing").dense_reference(x, pad)[0]
    torch.testing.assert_close(static[0], reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("max_clusters", [1, 3, 32])
def test_routing_bounds_hold_for_every_length(max_clusters):
    """The static capacity is the largest any n <= T valid frames give, and C on device
    equals the host's formula."""
    for T in (1, 2, 9, 10, 63, 64, 65, 200):
        caps = [-(-n // routing.num_clusters(n, max_clusters)) for n in range(1, T + 1)]
        assert routing.capacity_bound(T, max_clusters) == max(caps)
    n = torch.arange(0, 5000)
    want = [routing.num_clusters(int(i), max_clusters) for i in n]
    assert routing.num_clusters_tensor(n, max_clusters).tolist() == want


def test_lsh_transpose_pointers_without_bincount():
    """The row pointers of the transposed pattern (a search of the sorted keys, no
    data-dependent size) equal a bincount's."""
    g = torch.Generator().manual_seed(0)
    col = torch.randint(0, 50, (400,), generator=g)
    col[col == 7] = 8  # a key without entries
    by_key = col.argsort(stable=True)
    counted = F.pad(torch.bincount(col, minlength=60).cumsum(0), (1, 0))
    torch.testing.assert_close(sparse_topk.key_pointers(col, by_key, 60), counted)


@pytest.mark.parametrize("mdtype", [torch.float16, torch.float64])
def test_lsh_gpu_match_dtype_and_one_chunk_give_the_same_keys(mdtype, monkeypatch):
    """The GPU's tensor version with its code matmul dtype (float16, or float64 for many bits)
    selects the same keys as the CPU kernel."""
    g = torch.Generator().manual_seed(0)
    cq, ck = (torch.rand(3, 300, 8, generator=g) > 0.5 for _ in range(2))
    kv = torch.rand(3, 300, generator=g) > 0.2
    want = topk.topk_by_match(cq, ck, kv, 9)
    monkeypatch.setattr(topk, "_use_cpu_kernel", lambda t: False)
    monkeypatch.setattr(topk, "_match_dtype", lambda K, device: mdtype)
    assert torch.equal(topk.topk_by_match(cq, ck, kv, 9), want)


@pytest.mark.parametrize("name", ["xbox", "routing"])
def test_long_kernels_compile_without_graph_breaks(name, monkeypatch):
    """Forward (and, through AOTAutograd, backward) of the long kernels as one graph, padded,
    in training mode (routing moves its centroids; LSH's CSR products are one custom op)."""
    attn = make(name).train()
    monkeypatch.setattr(type(attn), "short_path_max_t", 0)
    x, pad = batch([24, 17])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda x, pad: attn(x, pad).sum())(x, pad)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_lsh_names_cover_the_family():
    assert all(make(n).k == 5 for n in LSH) and DIM % HEADS == 0

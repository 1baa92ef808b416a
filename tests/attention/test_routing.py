"""routing: cluster selection, balanced capacity, local heads and the EMA centroids."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from _attention_testing import HEADS, batch, make

from speechattn.attention import build, routing
from speechattn.attention.pruning import prune_heads

LOCAL = (HEADS + 1) // 2  # heads [0, LOCAL) are local, the others route


def _expected_support(attn, x, pad) -> torch.Tensor:
    """(B, h, T, T) keys each query may use, from the definition (docs/attention.md) written out here."""
    q, k, _ = attn._qkv(x)
    B, h, T, _ = q.shape
    out = torch.zeros(B, h, T, T, dtype=torch.bool)
    for b in range(B):
        n = int((~pad[b]).sum())
        C = min(math.ceil(math.sqrt(n)), attn.max_clusters)
        cap = math.ceil(n / C)
        for head in range(h):
            for i in range(n):
                out[b, head, i, i] = True
            if head < LOCAL:
                for i in range(n):
                    for j in range(n):
                        out[b, head, i, j] |= abs(i - j) <= attn.window
                continue
            sim = k[b, head, :n] @ attn.centroids[head - LOCAL, :C].T  # (n, C)
            best, cluster = sim.max(-1)
            kept = set()
            for c in range(C):
                members = [j for j in range(n) if cluster[j] == c]
                members.sort(key=lambda j: (-float(best[j].detach()), j))
                kept |= set(members[:cap])
            for i in range(n):
                for j in kept:
                    out[b, head, i, j] |= bool(cluster[i] == cluster[j])
    return out


@pytest.mark.parametrize("lengths", [[40, 23, 1], [90]])
def test_support_matches_the_definition(lengths):
    attn = make("routing")  # w = 2, at most 3 clusters: capacities of ~T/3 frames
    x, pad = batch(lengths)
    _, w = attn(x, pad, need_weights=True)
    expected = _expected_support(attn, x, pad)
    assert torch.equal(w > 0, expected & (w > 0))  # weight only inside the support
    # every supported key but self gets weight (self only when alone: shared-QK penalty)
    off_diagonal = expected & ~torch.eye(x.shape[1], dtype=torch.bool)
    assert (w[off_diagonal] > 0).all()


def test_clusters_are_balanced_and_some_members_dropped():
    """At most ceil(T / C) keys per cluster, all from the query's own cluster; an unbalanced
    routing really drops members, and a dropped query still attends its cluster's kept ones."""
    attn = make("routing", max_clusters=4)
    valid = torch.ones(1, 64, dtype=torch.bool)
    x, _ = batch([64])
    q, k, _ = attn._qkv(x)
    idx = attn.select(q, k, valid)  # (1, h, T, kk)
    routes = attn.route(k[:, LOCAL:], valid)
    cap = int(routes.capacity[0])
    assert cap == 16  # C = min(ceil(sqrt(64)), 4) = 4 clusters of at most 16
    assert idx.shape[-1] == 1 + max(2 * attn.window, cap)
    dropped = 0
    for head in range(HEADS - LOCAL):
        cluster = routes.cluster[0, head]
        for c in cluster.unique().tolist():
            members = (cluster == c).nonzero().flatten()
            keys = set(idx[0, LOCAL + head, members, 1:].flatten().tolist())
            assert keys <= set(members.tolist()) and len(keys) == min(cap, len(members))
            for i in members.tolist():  # every member sees all kept keys (or is one)
                assert set(idx[0, LOCAL + head, i].tolist()) - {i} == keys - {i}
            dropped += max(0, len(members) - cap)
    assert dropped > 0


def test_fast_selection_equals_reference_with_truncation():
    """`select` (sorts and a member table) equals `selection_dense` (pairwise ranks)."""
    attn = make("routing", max_clusters=5)
    x, pad = batch([120, 77, 31])
    q, k, _ = attn._qkv(x)
    idx = attn.select(q, k, ~pad)
    T = x.shape[1]
    fast = torch.zeros(idx.shape[:-1] + (T,), dtype=torch.bool).scatter(-1, idx, True)
    ref = attn.selection_dense(q, k, ~pad)
    valid_rows = (~pad)[:, None, :, None]
    assert torch.equal(fast & valid_rows, ref & valid_rows)
    routed = fast[:, LOCAL:] & ~torch.eye(T, dtype=torch.bool)  # local bands are masked later
    assert not (routed & pad[:, None, None, :]).any()  # padded keys never join a cluster


def test_ema_moves_centroids_towards_member_means_in_training_only():
    attn = make("routing", decay=0.9)
    x, pad = batch([30, 18])
    before = attn.centroids.clone()
    attn(x, pad)  # eval: fixed
    assert torch.equal(attn.centroids, before)
    q, k, _ = attn._qkv(x)
    routes = attn.route(k[:, LOCAL:], ~pad)  # assignment before the update
    attn.train()
    attn(x, pad)
    for head in range(HEADS - LOCAL):
        for c in range(attn.max_clusters):
            members = k[:, LOCAL + head][routes.cluster[:, head] == c]  # (n, d_k)
            old, new = before[head, c], attn.centroids[head, c]
            if len(members) == 0:
                assert torch.equal(new, old)
                continue
            mean = members.mean(0)
            want = F.normalize(0.9 * old + 0.1 * mean, dim=0)
            torch.testing.assert_close(new, want)
            cos = F.cosine_similarity
            assert cos(new, mean, dim=0) > cos(old, mean, dim=0)  # closer to its members
    assert not torch.equal(attn.centroids, before)


def _ema_on_one_rank(rank: int, rendezvous: str, out_dir: str, max_clusters: int | None) -> None:
    """One of two gloo ranks: a training pass over its half of the batch, padded only to its
    own longest utterance (so the ranks' T differ), centroids saved."""
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    try:
        attn = make("routing", decay=0.9, max_clusters=max_clusters).train()
        x, pad = batch([30, 18, 25, 9])
        half, frames = slice(2 * rank, 2 * rank + 2), (30, 25)[rank]
        attn(x[half, :frames], pad[half, :frames])
        torch.save(attn.centroids, f"{out_dir}/centroids{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("max_clusters", [3, None])
def test_ema_under_data_parallel_steps_every_rank_by_the_whole_batch(tmp_path, max_clusters):
    """Two ranks, each with half of the batch and its own padded length, end with the
    centroids that one process gets from the whole batch (the members' sums and counts are
    summed over the ranks). With a cap the ranks reduce over it; without one (rank 0 uses
    ceil(sqrt(30)) = 6 centroids, rank 1 ceil(sqrt(25)) = 5) they agree on the larger."""
    rendezvous = f"file://{tmp_path}/rendezvous"
    torch.multiprocessing.spawn(
        _ema_on_one_rank, args=(rendezvous, str(tmp_path), max_clusters), nprocs=2
    )
    whole = make("routing", decay=0.9, max_clusters=max_clusters).train()
    x, pad = batch([30, 18, 25, 9])
    before = whole.centroids.clone()
    whole(x, pad)
    for rank in range(2):
        centroids = torch.load(tmp_path / f"centroids{rank}.pt", weights_only=True)
        torch.testing.assert_close(centroids, whole.centroids, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(whole.centroids, before)


def test_ema_is_deterministic_and_centroids_save_with_the_model():
    x, pad = batch([25, 12])
    a, b = make("routing").train(), make("routing").train()
    a(x, pad)
    b(x, pad)
    assert torch.equal(a.centroids, b.centroids)
    assert "centroids" in a.state_dict()
    fresh = make("routing", seed=1)
    assert not torch.equal(fresh.centroids, a.centroids)
    fresh.load_state_dict(a.state_dict())
    assert torch.equal(fresh.centroids, a.centroids)
    assert not a.centroids.requires_grad


def test_centroid_update_runs_in_float32_under_autocast():
    """The EMA step under bf16 autocast equals the float32 step on the same (rounded) keys."""
    x, pad = batch([50, 20])
    attn = build("routing", 32, 4, window=2, max_clusters=3)
    ref = build("routing", 32, 4, window=2, max_clusters=3)
    _, k, _ = attn._qkv(x.float())
    ref.update_centroids(k.bfloat16().float(), ~pad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn.update_centroids(k.bfloat16(), ~pad)
    assert attn.centroids.dtype == torch.float32
    assert torch.equal(attn.centroids, ref.centroids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attn(x.float(), pad).dtype == torch.bfloat16  # the caller's dtype comes back


def test_one_head_is_all_local():
    attn = build("routing", 32, 1, window=3).double().eval()
    x, pad = batch([9])
    _, w = attn(x, pad, need_weights=True)
    i = torch.arange(9)
    assert ((w[0, 0] > 0) <= ((i[:, None] - i[None, :]).abs() <= 3)).all()
    assert attn.centroids.shape[0] == 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"window": 0}, "window >= 1"),
        ({"max_clusters": 0}, "max_clusters"),
        ({"decay": 1.0}, "decay"),
    ],
)
def test_invalid_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        build("routing", 32, 4, **options)


def test_long_kernels_equal_reference_with_dropped_members(monkeypatch):
    """Band kernel (local heads) and gathered keys (routing heads) against the dense
    reference, at a length where clusters overflow their capacity."""
    monkeypatch.setattr(type(make("routing")), "short_path_max_t", 0)
    attn = make("routing", window=3, max_clusters=4)
    x, pad = batch([70, 41, 2])
    xi, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = attn(xi, pad)
    y_ref, _ = attn.dense_reference(xr, pad)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(xi.grad, xr.grad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("keep", [None, [0, 2, 3]], ids=["all", "pruned"])
def test_cluster_kernel_equals_reference_with_overfull_clusters(keep, monkeypatch):
    """The cluster-block kernel (routing heads above `short_path_max_t`) against the dense
    reference in float64, outputs and input gradients: padding, a cluster with more queries
    than the capacity W (several query blocks, members dropped) and a pruned module."""
    monkeypatch.setattr(type(make("routing")), "short_path_max_t", 0)
    attn = make("routing", window=3, max_clusters=4)
    if keep is not None:
        prune_heads(attn, keep)  # one local head and two routing heads left
    x, pad = batch([90, 57, 3])
    q, k, _ = attn._qkv(x)
    members = attn.members(k, ~pad)
    W = members.table.shape[-1]
    assert (members.counts > W).any()  # overfull: dropped members and two query blocks
    assert (members.counts[0] > 0).sum(-1).min() > 1  # several clusters per head
    xi, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = attn(xi, pad)
    y_ref, _ = attn.dense_reference(xr, pad)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    (y * w).sum().backward()
    (y_ref * w).sum().backward()
    torch.testing.assert_close(xi.grad, xr.grad, rtol=1e-9, atol=1e-11)


def test_cluster_kernel_dropout_in_training(monkeypatch):
    """Attention dropout reaches the cluster kernel (a module of routing heads only, centroids
    held): training outputs depend on the seed only, stay finite and are zero at padding."""
    monkeypatch.setattr(type(make("routing")), "short_path_max_t", 0)
    attn = make("routing", dropout=0.5)
    prune_heads(attn, [2, 3])
    assert attn.heads_local == 0
    monkeypatch.setattr(attn, "update_centroids", lambda k, valid: None)
    x, pad = batch([40, 25])
    y_eval = attn(x, pad)
    attn.train()
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(attn(x, pad))
    assert torch.isfinite(outs[2]).all() and (outs[2][pad] == 0).all()
    assert torch.equal(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])
    assert not torch.allclose(outs[0], y_eval)


def test_clusters_are_the_square_root_of_the_length_unless_capped(caplog):
    """C = ceil(sqrt(T)) at every length (46 at T = 2048, beyond the 32 stored at first);
    an explicit max_clusters caps it, and says so once."""
    attn = make("routing", max_clusters=None)
    assert attn.num_centroids(2048) == 46 and attn.centroids.shape[1] == 46
    assert routing.num_clusters(2048, None) == 46 and routing.num_clusters(2048, 32) == 32
    x, pad = batch([2048])
    q, k, _ = attn._qkv(x)
    used = attn.route(attn._routing_vectors(k), ~pad).cluster
    assert used.max() >= 32  # the added centroids take members
    capped = make("routing", max_clusters=32)
    with caplog.at_level(logging.INFO, logger="speechattn.attention.routing"):
        assert capped.num_centroids(2048) == 32 and capped.num_centroids(4096) == 32
    assert [r.message.count("max_clusters=32 caps") for r in caplog.records] == [1]
    # a module with more centroids stored loads into a fresh one
    fresh = make("routing", max_clusters=None)
    fresh.load_state_dict(attn.state_dict())
    assert torch.equal(fresh.centroids, attn.centroids)


def test_unshared_layers_start_from_their_own_centroids():
    def centroids(layer: int, seed: int = 0) -> torch.Tensor:
        return build("routing", 32, 4, layer=layer, seed=seed).centroids

    assert torch.equal(centroids(0), centroids(0))
    assert not torch.equal(centroids(0), centroids(1))
    assert not torch.equal(centroids(0), centroids(0, seed=1))
    grown = build("routing", 32, 4, layer=1)
    grown.num_centroids(2048)  # centroids added later are those a larger store starts with
    assert torch.equal(grown.centroids[:, :32], centroids(1))
    assert torch.equal(grown.centroids, grown.initial_centroids(0, 46))

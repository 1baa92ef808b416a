"""Routing attention (online k-means clustering of shared-QK vectors): `routing`.

Roy, Saffar, Vaswani, Grangier, "Efficient Content-Based Sparse Attention with Routing
Transformers", TACL 2021 (arXiv:2003.05997), section 4, bidirectional, on `shared_qk`'s
projections and scores. Local heads [0, ceil(h/2)) attend the band |i - j| <= w; routing
heads send each unit vector to its nearest of C = ceil(sqrt(T_valid)) centroids, keep each
cluster's top ceil(T_valid / C) members by similarity, and let a query attend the kept members
of its own cluster plus itself. Definition, options and kernels: docs/attention.md, "routing".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention import patterns
from speechattn.attention.autotune import pick_kernel
from speechattn.attention.base import (
    SELF_PENALTY,
    AttentionConfig,
    Flops,
    all_valid,
    key_mask,
    layer_seed,
    needs_static_shapes,
    require,
    widen,
)
from speechattn.attention.dot_product import SharedQKBase
from speechattn.attention.fp32 import ieee_matmul
from speechattn.attention.kernels.blocks import band_kernel
from speechattn.attention.kernels.cluster import (  # noqa: F401 (routing's sizes, re-exported)
    Members,
    blocks_bound,
    capacity_bound,
    cluster_kernel,
    num_clusters,
    num_clusters_tensor,
)
from speechattn.attention.kernels.masked import masked_heads
from speechattn.attention.pruning import select_
from speechattn.attention.registry import register

log = logging.getLogger(__name__)


def _data_parallel() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass
class RoutingConfig(AttentionConfig):
    window: int = 16  # w, local heads attend |i - j| <= w
    # Cap on C per utterance; None: C = ceil(sqrt(T_valid)) at every length (Roy et al.)
    max_clusters: int | None = None
    decay: float = 0.999  # EMA decay of the centroids (training only)
    seed: int = 0  # with the layer index, seeds the initial centroids

    def __post_init__(self) -> None:
        super().__post_init__()
        w, C = self.window, self.max_clusters
        require(
            w >= 1 and (C is None or C >= 1),
            f"routing needs window >= 1 and max_clusters >= 1, got window={w}, max_clusters={C}",
        )
        require(0.0 <= self.decay < 1.0, f"routing decay must be in [0, 1), got {self.decay}")


@dataclass
class Routes:
    """Cluster assignment of the routing heads' vectors, h_r = routing heads."""

    cluster: Tensor  # (B, h_r, T) long: nearest centroid, -1 at padded frames
    similarity: Tensor  # (B, h_r, T): dot product with that centroid
    capacity: Tensor  # (B,) long: members kept per cluster, ceil(T_valid / C)


@register("routing")
class RoutingAttention(SharedQKBase):
    """Shared-QK attention: local band heads and online k-means routing heads."""

    Config = RoutingConfig
    paper = (
        "Roy et al., Efficient Content-Based Sparse Attention with Routing Transformers, TACL 2021"
    )
    complexity_training = "O(T (w + T / C) D) attention + O(T C D) routing"
    complexity_inference = "O(T (w + T / C) D) attention + O(T C D) routing"
    short_path_max_t = 128  # all-pairs SDPA masked to the selection up to here
    kernel_names = ("short", "long", "masked")  # masked: the local heads' band as a mask
    all_pairs_kernels = ("short", "masked")

    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self.window = config.window
        self.max_clusters = config.max_clusters
        self.decay = config.decay
        self.heads_local = (config.num_heads + 1) // 2
        # (h_r, stored, d_k) unit vectors, the first C for C clusters: max_clusters, or those
        # of T = 1024, more added when a longer batch needs them.
        stored = num_clusters(1024, None) if self.max_clusters is None else self.max_clusters
        self.register_buffer("centroids", self.initial_centroids(0, stored))
        self._cap_logged = False

    def initial_centroids(self, start: int, stop: int) -> Tensor:
        """Initial centroids start..stop - 1 of the current routing heads: (h_r, stop - start,
        d_k) unit vectors, centroid c seeded by (`seed`, layer, c), whenever it is added."""
        config = self.config
        first = (config.num_heads + 1) // 2  # routing heads' original indices start here
        heads = torch.tensor([h - first for h in self.kept_heads if h >= first], dtype=torch.long)
        mu = torch.empty(config.num_heads - first, stop - start, config.head_dim)
        for c in range(start, stop):
            g = torch.Generator().manual_seed(layer_seed(config.seed, config.layer, c))
            mu[:, c - start] = torch.randn(config.num_heads - first, config.head_dim, generator=g)
        return F.normalize(mu[heads], dim=-1)  # (h_r, stop - start, d_k)

    def num_centroids(self, T: int) -> int:
        """Centroids used at T frames, with that many stored; logs once when the cap binds."""
        C = num_clusters(T, self.max_clusters)
        if C < num_clusters(T, None) and not self._cap_logged and not torch.compiler.is_compiling():
            self._cap_logged = True
            log.info(
                "routing (layer %d): max_clusters=%d caps the clusters below ceil(sqrt(T)) = %d "
                "at T = %d: clusters hold about T / %d frames",
                self.config.layer,
                C,
                num_clusters(T, None),
                T,
                C,
            )
        return self.num_centroids_stored(C)

    def _centroids_of_all_ranks(self, C: int) -> int:
        """A centroid count (>= C, stored) every rank reduces over this step: the cap, or an
        integer all-reduce and its host read."""
        if self.max_clusters is not None:
            return self.num_centroids_stored(self.max_clusters)
        most = torch.full((1,), C, device=self.centroids.device)  # a fill: no upload
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return self.num_centroids_stored(int(most))

    def num_centroids_stored(self, C: int) -> int:
        """C, with at least C centroids stored (new ones from their seeds)."""
        stored = self.centroids.shape[1]
        if C > stored:
            new = self.initial_centroids(stored, C).to(self.centroids)
            self.centroids = torch.cat([self.centroids, new], dim=1)
        return C

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        """Take a checkpoint's centroid count (a module with no cap grows its store with T)."""
        saved = state_dict.get(prefix + "centroids")
        if saved is not None and saved.shape[1] != self.centroids.shape[1]:
            shape = (self.centroids.shape[0], saved.shape[1], self.centroids.shape[2])
            self.centroids = self.centroids.new_empty(shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _remove_heads(self, index: Tensor) -> None:
        # local heads stay a prefix (index is sorted); routing heads keep their centroids
        routing = index[index >= self.heads_local] - self.heads_local
        self.heads_local = int((index < self.heads_local).sum())
        select_(self, "centroids", routing)

    def keys_attended(self, T: int) -> float:
        """Mean over heads of the band size and the cluster capacity ceil(T / C) (a bound)."""
        band = patterns.mean_band_size(T, self.window)
        cluster = float(math.ceil(T / num_clusters(T, self.max_clusters)))
        h_r = self.num_heads - self.heads_local
        return (self.heads_local * band + h_r * cluster) / self.num_heads

    def flops(self, T: int) -> Flops:
        h_r = self.num_heads - self.heads_local
        routing = 2.0 * T * num_clusters(T, self.max_clusters) * self.head_dim * h_r
        attention = self.dot_product_flops(T, self.keys_attended(T))
        return Flops(attention.differentiable, routing)  # distances to the centroids, no grad

    def route(self, k: Tensor, valid: Tensor) -> Routes:
        """Nearest centroid of every valid routing-head vector. k (B, h_r, T, d_k) unit vectors."""
        B, h_r, T, _ = k.shape
        Cm = self.num_centroids(T)
        n_valid = valid.sum(-1)  # (B,), on device: no host read
        C = num_clusters_tensor(n_valid, self.max_clusters)  # (B,), each <= Cm
        capacity = (n_valid.clamp_min(1) + C - 1) // C
        mu = self.centroids[:, :Cm].to(k.dtype)  # (h_r, Cm, d_k)
        sim = ieee_matmul(k, mu.transpose(-1, -2)[None])  # (B, h_r, T, Cm), true float32
        unused = torch.arange(Cm, device=k.device) >= C[:, None]  # (B, Cm)
        sim = sim.masked_fill(unused[:, None, None, :], float("-inf"))
        similarity, cluster = sim.max(dim=-1)  # (B, h_r, T): first maximum on ties
        cluster = cluster.masked_fill(~valid[:, None, :], -1)
        return Routes(cluster, similarity, capacity)

    def _routing_vectors(self, k: Tensor) -> Tensor:
        return widen(k[:, self.heads_local :])

    @torch.no_grad()
    def update_centroids(self, k: Tensor, valid: Tensor) -> None:
        """EMA step of each used centroid towards its members: k (B, h, T, d_k), valid (B, T)."""
        if self.num_heads == self.heads_local:
            return
        with torch.autocast(k.device.type, enabled=False):
            k = self._routing_vectors(k)
            routes = self.route(k, valid)
            Cm = self.num_centroids(k.shape[-2])  # the centroids `route` used
            if _data_parallel():  # ranks' batches differ in T: reduce over the largest table
                Cm = self._centroids_of_all_ranks(Cm)
            onehot = F.one_hot(routes.cluster.clamp_min(0), Cm).to(k.dtype)
            onehot = onehot * (routes.cluster >= 0)[..., None]  # (B, h_r, T, Cm)
            sums = ieee_matmul(onehot.transpose(-1, -2), k).sum(0)  # (h_r, Cm, d_k), true float32
            counts = onehot.sum(dim=(0, 2))[..., None]  # (h_r, Cm, 1)
            if _data_parallel():  # every rank moves its centroids by the whole batch
                statistics = torch.cat([sums, counts], dim=-1)
                dist.all_reduce(statistics)
                sums, counts = statistics[..., :-1], statistics[..., -1:]
            mean = sums / counts.clamp_min(1)
            mu = self.centroids[:, :Cm].to(k.dtype)
            moved = F.normalize(self.decay * mu + (1 - self.decay) * mean, dim=-1)
            self.centroids[:, :Cm] = torch.where(counts > 0, moved, mu)

    @torch.no_grad()
    def select(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Keys of every query (B, h, T, kk): itself, then its band or the kept members of its
        cluster; further columns equal to the query are fillers."""
        B, h, T, _ = q.shape
        i = torch.arange(T, device=q.device)
        # -w..-1, 1..w, made on the device (a host-made table would be copied every call)
        offsets = torch.arange(-self.window, self.window, device=q.device)
        band = i[:, None] + offsets + (offsets >= 0).long()  # (T, 2w)
        band = torch.where((band >= 0) & (band < T), band, i[:, None])  # out of range: filler
        parts = [band.expand(B, self.heads_local, T, -1)]
        if h > self.heads_local:  # kept members of each query's cluster, fillers = the query
            members = self.members(k, valid)
            cluster, table = members.cluster, members.table  # (B, h_r, T), (B, h_r, Cm, W)
            own = cluster.clamp_min(0)[..., None].expand(*cluster.shape, table.shape[-1])
            found = table.gather(2, own)  # (B, h_r, T, W)
            parts.append(torch.where((found >= 0) & (cluster >= 0)[..., None], found, i[:, None]))
        width = max(p.shape[-1] for p in parts)
        parts = [  # the narrower part padded with fillers (the query itself)
            torch.cat([p, i[:, None].expand(*p.shape[:-1], width - p.shape[-1])], dim=-1)
            for p in parts
        ]
        idx = torch.cat(parts, dim=1)  # (B, h, T, width)
        return torch.cat([i.expand(B, h, T)[..., None], idx], dim=-1)  # (B, h, T, kk)

    @torch.no_grad()
    def members(self, k: Tensor, valid: Tensor) -> Members:
        """Route the routing heads' keys k (B, h, T, d_k) and sort them into clusters by
        (cluster, similarity descending, position); width W: the batch's largest capacity on
        CPU eager, else `capacity_bound` (extra slots -1)."""
        with torch.autocast(k.device.type, enabled=False):
            routes = self.route(self._routing_vectors(k), valid)
            cluster, similarity, capacity = routes.cluster, routes.similarity, routes.capacity
            B, h_r, T = cluster.shape
            Cm = self.num_centroids(T)
            W = capacity_bound(T, Cm) if needs_static_shapes(capacity) else int(capacity.max())
            label = torch.where(cluster >= 0, cluster, Cm)  # padded frames sort last
            ranked = similarity.masked_fill(cluster < 0, 0)  # (B, h_r, T)
            order = ranked.argsort(dim=-1, descending=True, stable=True)
            order = order.gather(-1, label.gather(-1, order).argsort(dim=-1, stable=True))
            sorted_label = label.gather(-1, order)
            counts = F.one_hot(label, Cm + 1).sum(2)  # (B, h_r, Cm + 1)
            first = counts.cumsum(-1) - counts  # position of each cluster's first member
            rank = torch.arange(T, device=cluster.device) - first.gather(-1, sorted_label)
            kept = (rank < capacity[:, None, None]) & (sorted_label < Cm)
            slot = torch.where(kept, sorted_label * W + rank, Cm * W)  # Cm * W: discarded
            table = torch.full((B, h_r, Cm * W + 1), -1, dtype=torch.long, device=cluster.device)
            table.scatter_(-1, slot, order)
            table = table[..., :-1].view(B, h_r, Cm, W)
            return Members(cluster, order, sorted_label, rank, counts[..., :Cm], table)

    @torch.no_grad()
    def selection_dense(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Reference selection (B, h, T, T) bool, self included, from explicit pair tests."""
        B, h, T, _ = q.shape
        i = torch.arange(T, device=q.device)
        eye = i[:, None] == i[None, :]
        local = ((i[:, None] - i[None, :]).abs() <= self.window).expand(B, self.heads_local, T, T)
        if h == self.heads_local:
            return local
        with torch.autocast(q.device.type, enabled=False):
            routes = self.route(self._routing_vectors(k), valid)
        c, s = routes.cluster, routes.similarity  # (B, h_r, T)
        same = (c[..., :, None] == c[..., None, :]) & (c[..., None, :] >= 0)  # (B, h_r, T, T)
        ahead = (s[..., :, None] > s[..., None, :]) | (
            (s[..., :, None] == s[..., None, :]) & (i[:, None] < i[None, :])
        )
        rank = (same & ahead).sum(-2)  # (B, h_r, T): members of j's cluster ranked before j
        kept = (rank < routes.capacity[:, None, None]) & (c >= 0)
        routing = (same & kept[..., None, :]) | eye
        return torch.cat([local, routing], dim=1)

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        padded = valid is not None
        valid = all_valid(x) if valid is None else valid
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        hl, p = self.heads_local, self.dropout_p
        kernel = pick_kernel(self, q)
        # Select with the centroids as they were before this pass moves them.
        if kernel == "short":
            idx = self.select(q, k, valid)  # (B, h, T, kk)
            outs = [self._attend_short(q, k, v, idx, valid)]
        else:
            kv = key_mask(valid)
            local = q[:, :hl], k[:, :hl], v[:, :hl]
            if not hl:
                outs = []
            elif kernel == "masked":  # the band as a (1 or B, 1, T, T) mask, one SDPA call
                band = patterns.band_pattern(x.shape[1], self.window, x.device)
                outs = [masked_heads(*local, [(hl, band)], kv if padded else None, p)]
            else:
                outs = [band_kernel(*local, kv, self.window, p)]
            if self.num_heads > hl:
                members = self.members(k, valid)
                outs.append(cluster_kernel(q[:, hl:], k[:, hl:], v[:, hl:], members, p))
        if self.training:
            self.update_centroids(k, valid)
        return torch.cat(outs, dim=1)  # (B, h, T, d_k)

    def _attend_short(self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor) -> Tensor:
        """One SDPA call over all T x T pairs masked to the selection, self penalised."""
        T = q.shape[-2]
        eye = torch.eye(T, dtype=torch.bool, device=q.device)
        chosen = torch.zeros(idx.shape[:-1] + (T,), dtype=torch.bool, device=q.device)
        chosen = chosen.scatter(-1, idx, True) & key_mask(valid)[:, None, None, :] | eye
        bias = torch.zeros(chosen.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~chosen, float("-inf")) + eye * SELF_PENALTY  # (B, h, T, T)
        return self.sdpa(q, k, v, bias)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        T = q.shape[-2]
        eye = torch.eye(T, dtype=torch.bool, device=x.device)
        allowed = self.selection_dense(q, k, valid) & key_mask(valid)[:, None, None, :] | eye
        return self.weigh(self.shared_scores(q, k), allowed, v)

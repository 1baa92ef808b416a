"""Routing attention (online k-means clustering of shared-QK vectors): `routing`.

Roy, Saffar, Vaswani, Grangier, "Efficient Content-Based Sparse Attention with Routing
Transformers", TACL 2021 (arXiv:2003.05997), section 4 ("Routing attention"), bidirectional as
in the SPEC. Shared-QK projections and scores of `shared_qk` (keys = L2-normalised queries,
self penalised by -5e4 and always allowed, so a query attends to itself only when alone).

* local heads [0, ceil(h/2)): the band |i - j| <= w (w = `window`).
* routing heads [ceil(h/2), h): each L2-normalised shared-QK vector (query and key at once)
  goes to its nearest centroid on the unit sphere (largest dot product, ties to the lower
  index); per utterance C = min(ceil(sqrt(T_valid)), `max_clusters`) centroids of the head are
  used (the first C of its stored ones) and each cluster keeps its top ceil(T_valid / C)
  members by similarity (balanced clusters, ties to the earlier frame). A query attends to the
  kept members of its own cluster (whether or not it was kept itself), plus itself.
  Padded frames never join a cluster.

Centroids (h - ceil(h/2), max_clusters, d_k) are a buffer (saved and loaded with the model,
never touched by the optimiser). In training mode each forward pass moves every used centroid
towards the mean of the valid vectors assigned to it over the batch (exponential moving
average with `decay`, then back onto the unit sphere); eval mode leaves them fixed. The update
is deterministic (one-hot matrix products, no atomics). A layer shared across depths (ALBERT)
updates its centroids once per depth, from that depth's vectors. Under DDP each rank updates
its own copy from its own batch (not synchronised).

Selection is separate from attention, as in `lsh.py`: `select` gives each query's keys as
indices (B, h, T, kk) (column 0 = the query itself, the others its band or cluster; repeats of
itself are fillers); `selection_dense` builds the same (B, h, T, T) set explicitly for the
dense reference. Both route in float32 with autocast off (a cluster assignment is a hard
decision), never carry gradients and never move the centroids: the efficient forward pass
does that after selecting (`update_centroids`), so a selection can be held fixed in tests.

Attention on the selection: up to `short_path_max_t` frames one all-pairs SDPA call masked to
it; above, the local heads run the blocked band kernel of `sparse.py` and the routing heads
gather their kk keys, O(T kk d_k) per head, never T x T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.base import (
    SELF_PENALTY,
    AttentionConfig,
    Flops,
    key_mask,
    masked_softmax,
    scale,
    select_,
)
from speechattn.attention.dot_product import SharedQKBase
from speechattn.attention.registry import register
from speechattn.attention.sparse import band_kernel


@dataclass
class RoutingConfig(AttentionConfig):
    window: int = 16  # w, local heads attend |i - j| <= w
    max_clusters: int = 32  # centroids stored per routing head (C = ceil(sqrt(T)) up to T = 1024)
    decay: float = 0.999  # EMA decay of the centroids (training only)
    seed: int = 0  # seed of the initial centroids

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1 or self.max_clusters < 1:
            raise ValueError(
                f"routing needs window >= 1 and max_clusters >= 1, got window={self.window}, "
                f"max_clusters={self.max_clusters}"
            )
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"routing decay must be in [0, 1), got {self.decay}")


@dataclass
class Routes:
    """Cluster assignment of the routing heads' vectors, h_r = routing heads.

    cluster (B, h_r, T) long: nearest centroid, -1 at padded frames;
    similarity (B, h_r, T): dot product with that centroid;
    capacity (B,) long: members kept per cluster, ceil(T_valid / C).
    """

    cluster: Tensor
    similarity: Tensor
    capacity: Tensor


def num_clusters(num_valid: int, max_clusters: int) -> int:
    """C = ceil(sqrt(T_valid)) (Roy et al.: sqrt(n) clusters), at most `max_clusters`."""
    return max(1, min(math.ceil(math.sqrt(num_valid)), max_clusters))


@register("routing")
class RoutingAttention(SharedQKBase):
    """Shared-QK attention: local band heads and online k-means routing heads."""

    Config = RoutingConfig
    paper = (
        "Roy et al., Efficient Content-Based Sparse Attention with Routing Transformers, TACL 2021"
    )
    complexity_training = "O(T (w + sqrt(T)) D) attention + O(T sqrt(T) D) routing"
    complexity_inference = "O(T (w + sqrt(T)) D) attention + O(T sqrt(T) D) routing"
    # All-pairs SDPA masked to the selection up to here, band and gathered keys above.
    short_path_max_t = 512

    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self.window = config.window
        self.max_clusters = config.max_clusters
        self.decay = config.decay
        self.heads_local = (config.num_heads + 1) // 2
        h_r = config.num_heads - self.heads_local
        gen = torch.Generator().manual_seed(config.seed)
        mu = F.normalize(
            torch.randn(h_r, config.max_clusters, config.head_dim, generator=gen), dim=-1
        )
        self.register_buffer("centroids", mu)  # (h_r, max_clusters, d_k), unit vectors

    def _remove_heads(self, index: Tensor) -> None:
        # local heads stay a prefix (index is sorted); routing heads keep their centroids
        routing = index[index >= self.heads_local] - self.heads_local
        self.heads_local = int((index < self.heads_local).sum())
        select_(self, "centroids", routing)
        super()._remove_heads(index)

    # ----------------------------------------------------------------- metadata
    def keys_attended(self, T: int) -> float:
        """Mean over heads of: local heads, the band size; routing heads, the cluster
        capacity ceil(T / C) (an upper bound: a query of a smaller cluster sees fewer)."""
        i = torch.arange(T, dtype=torch.float64)
        w = self.window
        band = float((torch.clamp(i + w, max=T - 1) - torch.clamp(i - w, min=0) + 1).mean())
        cluster = float(math.ceil(T / num_clusters(T, self.max_clusters)))
        h_r = self.num_heads - self.heads_local
        return (self.heads_local * band + h_r * cluster) / self.num_heads

    def flops(self, T: int) -> Flops:
        h_r = self.num_heads - self.heads_local
        routing = 2.0 * T * num_clusters(T, self.max_clusters) * self.head_dim * h_r
        attention = self.shared_flops(T, self.keys_attended(T))
        return Flops(attention.differentiable, routing)  # distances to the centroids, no grad

    # ----------------------------------------------------------------- routing
    def route(self, k: Tensor, valid: Tensor) -> Routes:
        """Nearest centroid of every valid routing-head vector. k (B, h_r, T, d_k) unit vectors."""
        B, h_r, T, _ = k.shape
        n_valid = valid.sum(-1).tolist()
        C = torch.tensor([num_clusters(n, self.max_clusters) for n in n_valid], device=k.device)
        capacity = torch.tensor([max(1, n) for n in n_valid], device=k.device).add(C - 1) // C
        sim = k @ self.centroids.to(k.dtype).transpose(-1, -2)[None]  # (B, h_r, T, max_clusters)
        unused = torch.arange(self.max_clusters, device=k.device) >= C[:, None]  # (B, max_clusters)
        sim = sim.masked_fill(unused[:, None, None, :], float("-inf"))
        similarity, cluster = sim.max(dim=-1)  # (B, h_r, T): first maximum on ties
        cluster = cluster.masked_fill(~valid[:, None, :], -1)
        return Routes(cluster, similarity, capacity)

    def _routing_vectors(self, k: Tensor) -> Tensor:
        """The routing heads' keys in float32 (float64 stays): (B, h_r, T, d_k)."""
        k = k[:, self.heads_local :]
        return k.to(torch.promote_types(k.dtype, torch.float32))

    @torch.no_grad()
    def update_centroids(self, k: Tensor, valid: Tensor) -> None:
        """One EMA step of every used centroid towards the mean of its members.

        k (B, h, T, d_k) shared-QK keys (unit vectors), valid (B, T). Centroids without
        members stay where they are. Called by `attend` in training mode only.
        """
        if self.num_heads == self.heads_local:
            return
        with torch.autocast(k.device.type, enabled=False):
            k = self._routing_vectors(k)
            self._ema_step(k, self.route(k, valid))

    def _ema_step(self, k: Tensor, routes: Routes) -> None:
        onehot = F.one_hot(routes.cluster.clamp_min(0), self.max_clusters).to(k.dtype)
        onehot = onehot * (routes.cluster >= 0)[..., None]  # (B, h_r, T, max_clusters)
        sums = torch.einsum("bhtc,bhtd->hcd", onehot, k)  # (h_r, max_clusters, d_k)
        counts = onehot.sum(dim=(0, 2))[..., None]  # (h_r, max_clusters, 1)
        mean = sums / counts.clamp_min(1)
        mu = self.centroids.to(k.dtype)
        moved = F.normalize(self.decay * mu + (1 - self.decay) * mean, dim=-1)
        self.centroids.copy_(torch.where(counts > 0, moved, mu))

    @torch.no_grad()
    def select(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Keys of every query (B, h, T, kk): column 0 the query itself, then its band (local
        heads) or the kept members of its cluster (routing heads); columns equal to the query
        are fillers."""
        B, h, T, _ = q.shape
        i = torch.arange(T, device=q.device)
        offsets = torch.cat([torch.arange(-self.window, 0), torch.arange(1, self.window + 1)])
        band = i[:, None] + offsets.to(q.device)  # (T, 2w)
        band = torch.where((band >= 0) & (band < T), band, i[:, None])  # out of range: filler
        parts = [band.expand(B, self.heads_local, T, -1)]
        if h > self.heads_local:
            with torch.autocast(q.device.type, enabled=False):
                routes = self.route(self._routing_vectors(k), valid)
            parts.append(self._cluster_members(routes))
        width = max(p.shape[-1] for p in parts)
        parts = [  # the narrower part padded with fillers (the query itself)
            torch.cat([p, i[:, None].expand(*p.shape[:-1], width - p.shape[-1])], dim=-1)
            for p in parts
        ]
        idx = torch.cat(parts, dim=1)  # (B, h, T, width)
        return torch.cat([i.expand(B, h, T)[..., None], idx], dim=-1)  # (B, h, T, kk)

    def _cluster_members(self, routes: Routes) -> Tensor:
        """Kept members of each query's cluster (B, h_r, T, max capacity), fillers = query.

        Sort by (cluster, similarity descending, position) with two stable sorts; a member's
        rank in its cluster is its sorted position minus the cluster's first position.
        """
        cluster, similarity, capacity = routes.cluster, routes.similarity, routes.capacity
        B, h_r, T = cluster.shape
        Cm, W = self.max_clusters, int(capacity.max())
        label = torch.where(cluster >= 0, cluster, Cm)  # padded frames sort last
        order = similarity.masked_fill(cluster < 0, 0).sort(dim=-1, descending=True, stable=True)[1]
        order = order.gather(
            -1, label.gather(-1, order).sort(dim=-1, stable=True)[1]
        )  # (B, h_r, T)
        sorted_label = label.gather(-1, order)
        counts = F.one_hot(label, Cm + 1).sum(2)  # (B, h_r, Cm + 1)
        first = counts.cumsum(-1) - counts  # position of each cluster's first member
        rank = torch.arange(T, device=cluster.device) - first.gather(-1, sorted_label)
        kept = (rank < capacity[:, None, None]) & (sorted_label < Cm)
        slot = torch.where(kept, sorted_label * W + rank, Cm * W)  # Cm * W: discarded
        table = torch.full((B, h_r, Cm * W + 1), -1, dtype=torch.long, device=cluster.device)
        table.scatter_(-1, slot, order)  # (B, h_r, Cm W + 1): members by cluster, -1 empty
        own = cluster.clamp_min(0)[..., None] * W + torch.arange(W, device=cluster.device)
        members = table.gather(-1, own.view(B, h_r, T * W)).view(B, h_r, T, W)
        i = torch.arange(T, device=cluster.device)[:, None]
        return torch.where((members >= 0) & (cluster >= 0)[..., None], members, i)

    @torch.no_grad()
    def selection_dense(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Reference selection (B, h, T, T) bool, self included, from explicit pair tests:
        local |i - j| <= w; routing: same cluster and j ranks below the capacity among its
        cluster (counting members with a larger similarity, or equal and earlier)."""
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

    # ----------------------------------------------------------------- attention
    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (B, h, T, d_k) as `select` takes them (the name `lsh.py` uses)."""
        return self.shared_qkv(x)

    def attend(self, x: Tensor, valid: Tensor) -> Tensor:
        q, k, v = self.shared_qkv(x)  # (B, h, T, d_k)
        T = q.shape[-2]
        idx = self.select(q, k, valid)  # (B, h, T, kk)
        if self.training:
            self.update_centroids(k, valid)
        if T <= self.short_path_max_t:
            return self._attend_short(q, k, v, idx, valid)
        hl, p = self.heads_local, (self.dropout if self.training else 0.0)
        kv = key_mask(valid)
        outs = [band_kernel(q[:, :hl], k[:, :hl], v[:, :hl], kv, self.window, p)] if hl else []
        if self.num_heads > hl:
            outs.append(self._attend_gathered(q[:, hl:], k[:, hl:], v[:, hl:], idx[:, hl:], kv))
        return torch.cat(outs, dim=1)  # (B, h, T, d_k)

    def _attend_short(self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor) -> Tensor:
        """One fused SDPA call over all T x T pairs: 0 on the selected valid keys and on self
        (penalised), -inf elsewhere."""
        T = q.shape[-2]
        eye = torch.eye(T, dtype=torch.bool, device=q.device)
        chosen = torch.zeros(idx.shape[:-1] + (T,), dtype=torch.bool, device=q.device)
        chosen = chosen.scatter(-1, idx, True) & key_mask(valid)[:, None, None, :] | eye
        bias = torch.zeros(chosen.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~chosen, float("-inf")) + eye * SELF_PENALTY  # (B, h, T, T)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)

    def _attend_gathered(self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, kv: Tensor) -> Tensor:
        """Each query against its kk selected keys only: q, k, v (B, H, T, d), idx (B, H, T, kk),
        kv (B, T) allowed keys -> (B, H, T, d). Column 0 is self (penalised, always allowed)."""
        B, H, T, d = q.shape
        kk = idx.shape[-1]
        i = torch.arange(T, device=q.device)[:, None]
        ok = kv.gather(1, idx.reshape(B, -1)).view(idx.shape) & (idx != i)  # fillers out
        ok[..., 0] = True  # the query itself
        rows = (idx + torch.arange(B * H, device=q.device).view(B, H, 1, 1) * T).reshape(-1)
        kg = k.reshape(B * H * T, d).index_select(0, rows).view(B, H, T, kk, d)
        vg = v.reshape(B * H * T, d).index_select(0, rows).view(B, H, T, kk, d)
        s = torch.einsum("bhtd,bhtkd->bhtk", q, kg) * scale(d)  # (B, H, T, kk)
        s = s + (torch.arange(kk, device=q.device) == 0).to(s.dtype) * SELF_PENALTY
        probs = self.drop(masked_softmax(s, ok))
        return torch.einsum("bhtk,bhtkd->bhtd", probs, vg)  # (B, H, T, d)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self.shared_qkv(x)  # (B, h, T, d_k)
        T = q.shape[-2]
        eye = torch.eye(T, dtype=torch.bool, device=x.device)
        allowed = self.selection_dense(q, k, valid) & key_mask(valid)[:, None, None, :] | eye
        weights = masked_softmax(self.shared_scores(q, k), allowed)  # (B, h, T, T)
        return self.drop(weights) @ v, weights

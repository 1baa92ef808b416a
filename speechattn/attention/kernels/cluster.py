"""Routing's cluster kernel: each cluster's queries in blocks against the cluster's kept members,
all blocks of all heads in one SDPA call (`routing.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.base import SELF_PENALTY, needs_static_shapes


def num_clusters(num_valid: int, max_clusters: int | None) -> int:
    """C = ceil(sqrt(T_valid)) (Roy et al.), at most `max_clusters` (None: no cap)."""
    c = max(1, math.isqrt(max(0, num_valid - 1)) + 1)
    return c if max_clusters is None else min(c, max_clusters)


def num_clusters_tensor(num_valid: Tensor, max_clusters: int | None) -> Tensor:
    """`num_clusters` on device, exact integer arithmetic: num_valid (B,) long -> C (B,)."""
    n = num_valid.clamp_min(1)
    c = n.double().sqrt().ceil().long()  # off by one at most: corrected below
    c = c - ((c - 1) * (c - 1) >= n).long()
    c = c + (c * c < n).long()
    return c.clamp(1, max_clusters)  # max None: no upper bound


def capacity_bound(T: int, max_clusters: int | None) -> int:
    """The largest capacity ceil(n / C(n)) of any n <= T valid frames (W independent of data):
    T's own, as capacity never decreases with n (at n = c^2 + 1, where C becomes c + 1, it
    stays c)."""
    return -(-T // num_clusters(T, max_clusters))


def blocks_bound(T: int, W: int, max_clusters: int | None) -> int:
    """Most query blocks of W one head of `cluster_kernel` can need for n <= T valid frames:
    sum_c ceil(n_c / W) <= (n + C (W - 1)) / W over C <= C(T) non-empty clusters."""
    return max(1, (T + num_clusters(T, max_clusters) * (W - 1)) // W)


@dataclass
class Members:
    """Routing heads' frames sorted by (cluster, similarity descending, position), h_r heads,
    Cm = C(T), the most clusters of any utterance, W = the largest capacity in the batch."""

    cluster: Tensor  # (B, h_r, T) long: cluster of each position, -1 at padded frames
    order: Tensor  # (B, h_r, T) long: positions in sorted order, padded frames last
    label: Tensor  # (B, h_r, T) long: cluster of each sorted frame, Cm for padded frames
    rank: Tensor  # (B, h_r, T) long: rank of each sorted frame in its cluster
    counts: Tensor  # (B, h_r, Cm) long: cluster sizes
    table: Tensor  # (B, h_r, Cm, W) long: kept members (the first `capacity`), -1 empty


def cluster_kernel(q: Tensor, k: Tensor, v: Tensor, members: Members, p: float = 0.0) -> Tensor:
    """Each query against the kept members of its cluster. q, k, v (B, H, T, d) -> (B, H, T, d).

    Each cluster's queries (in `members` order) in blocks of at most W against its W-slot key
    table: one SDPA call over (B H nb, 1, W, d) blocks, self penalised (a query not kept has
    kept members beside it, so needs no key of its own). Padded frames get 0. nb: the batch's
    largest count on CPU eager, else `blocks_bound` (extra blocks empty, discarded).
    """
    B, H, T, d = q.shape
    Cm, W = members.table.shape[-2:]
    real = members.label < Cm  # (B, H, T), sorted: padded frames last
    blocks = -(-members.counts // W)  # (B, H, Cm) blocks per cluster
    ends = blocks.cumsum(-1)
    if needs_static_shapes(ends):
        nb = blocks_bound(T, W, Cm)
    else:
        nb = max(1, int(ends[..., -1].max()))  # blocks per head, padded to the batch's largest
    # Block and slot of every sorted query; padded frames go to a discarded slot nb W.
    label = members.label.clamp_max(Cm - 1)
    block = (ends - blocks).gather(-1, label) + members.rank // W
    slot = torch.where(real, block * W + members.rank % W, nb * W)
    qpos = torch.full((B, H, nb * W + 1), -1, dtype=torch.long, device=q.device)
    qpos = qpos.scatter_(-1, slot, members.order)[..., :-1].view(B, H, nb, W)
    # Cluster of each block: the number of clusters whose blocks end at or before it.
    steps = torch.arange(nb, device=q.device).expand(B, H, nb).contiguous()
    owner = torch.searchsorted(ends, steps, right=True).clamp_max(Cm - 1)  # (B, H, nb)
    kpos = members.table.gather(2, owner[..., None].expand(B, H, nb, W))  # (B, H, nb, W)

    # Empty query slots (ends of blocks, unused blocks) may use every key: finite, discarded.
    q_in, k_in = (qpos >= 0)[..., :, None], (kpos >= 0)[..., None, :]
    is_self = (qpos[..., :, None] == kpos[..., None, :]) & q_in
    mask = torch.zeros(is_self.shape, dtype=q.dtype, device=q.device)
    mask = mask.masked_fill(q_in & ~k_in, float("-inf")) + is_self.to(q.dtype) * SELF_PENALTY

    base = torch.arange(B * H, device=q.device).view(B, H, 1, 1) * T  # row of (b, h, 0)

    def rows(t: Tensor, pos: Tensor) -> Tensor:  # (B, H, T, d) -> (B H nb, 1, W, d)
        index = (pos.clamp_min(0) + base).reshape(-1)
        return t.reshape(B * H * T, d).index_select(0, index).view(B * H * nb, 1, W, d)

    out = F.scaled_dot_product_attention(
        rows(q, qpos), rows(k, kpos), rows(v, kpos), attn_mask=mask.view(-1, 1, W, W), dropout_p=p
    )  # (B H nb, 1, W, d)
    # Back to positions: each valid query reads its slot, padded ones a zero row.
    out = F.pad(out.view(B * H, nb * W, d), (0, 0, 0, 1))  # (B H, nb W + 1, d)
    where = torch.empty_like(slot).scatter_(-1, members.order, slot)  # (B, H, T) slot of t
    where = where + torch.arange(B * H, device=q.device).view(B, H, 1) * (nb * W + 1)
    return out.view(-1, d).index_select(0, where.view(-1)).view(B, H, T, d)

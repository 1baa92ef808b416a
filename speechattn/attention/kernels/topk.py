"""LSH's selection kernel for GPUs, static shapes (no host read, the same code under
torch.compile): the top-k keys of each query by code match, ties broken by the true score, then
by position (`lsh.py`; on the CPU `topk_cpu.py`; the algorithm in docs/attention.md, LSH).

Per query row each key gets a small integer level (`_chunk_levels`); the k-th largest level c*
is found by counting (`_threshold`); keys above c* are in, and those at c* compete for the
remaining slots (`_finish_dense` by score, `_nearest` by position).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.base import widen
from speechattn.attention.fp32 import ieee_matmul
from speechattn.attention.kernels.topk_cpu import lsh_topk_cpu

# Elements of one (B h, chunk, T) block of match levels: as large as memory allows (its dense
# float64 scores take 1 GiB), so that a layer is a few chunks, not thousands of launches.
_MATCH_CHUNK = 1 << 27


def _use_cpu_kernel(t: Tensor) -> bool:
    """Whether the CPU kernel selects (tests replace this to run this version on the CPU)."""
    return t.device.type == "cpu"


def _top_level(K: int) -> int:
    """The largest level (a valid other key matching in all K bits)."""
    return 2 * K + 4


def _match_dtype(K: int, device: torch.device) -> torch.dtype:
    """dtype of the code matmul, exact as every partial sum lies in [0, 2K + 4]: float16 on GPUs
    (exact to 2048; tensor cores), else float32 (true float32 through `ieee_matmul`)."""
    if device.type != "cpu" and _top_level(K) <= 2048:
        return torch.float16
    return torch.float32


def _level_dtype(K: int) -> torch.dtype:
    """uint8 levels while the top fits, else int16."""
    if _top_level(K) >= (1 << 15):
        raise ValueError(f"LSH: bits={K} is too many for the int16 match levels")
    return torch.uint8 if _top_level(K) < (1 << 8) else torch.int16


def _count_dtype(T: int) -> torch.dtype:
    """Counts and prefix counts over T keys: int16 (faster sums) while T fits."""
    return torch.int16 if T < (1 << 15) else torch.int32


def ordered_bits(score: Tensor) -> Tensor:
    """Float scores as int64 in [0, 2^32) in the same order, equal only when equal in float32:
    the float32 bits, negative values' magnitude bits flipped (-0.0 counts as +0.0)."""
    bits = (widen(score).float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long() + (1 << 31)


def tie_scores(q: Tensor, keys: Tensor) -> Tensor:
    """All-pairs tie-break scores q_i . keys_j, (..., Tq, d) x (..., Tk, d) -> (..., Tq, Tk)
    float32: float64 sums of the exact products, rounded, so that they equal the CPU kernel's
    per-pair sums (float32 sums of one pair round differently in a loop and a matmul)."""
    return ieee_matmul(q.double(), keys.double().transpose(-1, -2)).float()


def _chunk_levels(cq: Tensor, ck: Tensor, kv: Tensor) -> Callable[[int, int], Tensor]:
    """levels(s, e): the levels (N, e - s, T) of query rows s..e-1 against every key, from cq, ck
    (N, T, K) codes and kv (N, T) allowed keys; highest first (`lsh.py: selection_dense`):

        allowed other key   K + 4 + match   in [K + 4, 2K + 4]
        own key, allowed    K + 3
        disallowed key      2 + match       in [2, K + 2]
        own key, disallowed 1

    Sign bits: one matmul a_i . b_j = match_ij + offset_j (a = [c; ~c; 1], b = [c; ~c;
    offset]); l2 buckets: one comparison per hash, added into the levels.
    """
    N, T, K = cq.shape
    ldtype = _level_dtype(K)
    offset = torch.where(kv, K + 4, 2)  # (N, T): a key's level less its match
    own = torch.where(kv, K + 3, 1).to(ldtype)  # (N, T): the levels of the diagonal
    if cq.dtype == torch.bool:
        mdtype = _match_dtype(K, cq.device)
        a = torch.cat([cq, ~cq, torch.ones_like(cq[..., :1])], dim=-1).to(mdtype)
        b = torch.cat([ck.to(mdtype), (~ck).to(mdtype), offset[..., None].to(mdtype)], dim=-1)
        bT = b.transpose(-1, -2).contiguous()

        def match(s: int, e: int) -> Tensor:
            return ieee_matmul(a[:, s:e], bT).to(ldtype)
    else:
        key_offset = offset.to(ldtype)[:, None, :]  # (N, 1, T)
        cqT, ckT = cq.transpose(1, 2).contiguous(), ck.transpose(1, 2).contiguous()  # (N, K, T)

        def match(s: int, e: int) -> Tensor:
            lvl = key_offset.expand(N, e - s, T).clone()
            for j in range(K):
                lvl += cqT[:, j, s:e, None] == ckT[:, j, None, :]
            return lvl

    def levels(s: int, e: int) -> Tensor:
        lvl = match(s, e)
        lvl.diagonal(offset=s, dim1=-2, dim2=-1).copy_(own[:, s:e])  # (N, e - s): keys s..e-1
        return lvl

    return levels


def _count(mask: Tensor) -> Tensor:
    """Row sums (N, C, 1) of a bool mask (N, C, T) in `_count_dtype`."""
    return mask.sum(-1, keepdim=True, dtype=_count_dtype(mask.shape[-1]))


def _threshold(lvl: Tensor, kk: int, top: int) -> Tensor:
    """c* (N, C, 1): the largest level c with at least kk keys at level >= c, per row, by binary
    lifting from c = 1 (where all T >= kk keys count): one counting pass per bit of `top`."""
    lo = torch.ones(lvl.shape[:-1] + (1,), dtype=torch.int16, device=lvl.device)
    for b in reversed(range(top.bit_length())):
        cand = (lo + (1 << b)).clamp_max(top + 1)  # above the top: counts 0, never taken
        lo = torch.where(_count(lvl >= cand) >= kk, cand, lo)
    return lo.to(lvl.dtype)


def _nearest(mask: Tensor, m: Tensor, s: int) -> Tensor:
    """Bool mask (N, C, T) of the m (N, C, 1) keys of each row of mask (N, C, T) nearest to the
    row's query i = s + c, the earlier of two equidistant ones first; m <= the row's count.
    Prefix counts give the keys within d of i in O(1), a bisection over d the distance d* at
    which m is reached: keys nearer are in, of the (at most two) at d* the earlier first."""
    N, C, T = mask.shape
    dev = mask.device
    cdt = _count_dtype(T)
    prefix = F.pad(mask.cumsum(-1, dtype=cdt), (1, 0))  # (N, C, T + 1): keys before j
    i = torch.arange(s, s + C, device=dev)[:, None].expand(N, C, 1)

    def within(d: Tensor) -> Tensor:  # keys with |j - i| <= d, d >= 0
        hi = prefix.gather(-1, (i + d).clamp(-1, T - 1) + 1)
        return hi - prefix.gather(-1, (i - d).clamp(0, T))

    d = torch.full((N, C, 1), -1, dtype=torch.long, device=dev)  # within(d) < m
    for b in reversed(range(T.bit_length())):
        cand = (d + (1 << b)).clamp_max(T)  # T: beyond every key, never taken
        d = torch.where(within(cand) < m, cand, d)
    rest = m - torch.where(d >= 0, within(d.clamp_min(0)), 0)  # 0, 1 or 2 keys at d* = d + 1
    d = d + 1
    rows = torch.arange(s, s + C, dtype=torch.int32, device=dev)[:, None]
    dist = (torch.arange(T, dtype=torch.int32, device=dev) - rows).abs()  # (C, T), all heads
    chosen = mask & (dist < d)
    left, right = (i - d).clamp(0, T - 1), (i + d).clamp(0, T - 1)
    take_left = (rest > 0) & (i - d >= 0) & mask.gather(-1, left)
    take_right = ((rest > 1) | ((rest > 0) & ~take_left)) & (i + d < T) & (d > 0)
    take_right &= mask.gather(-1, right)
    # one key per row on each side: plain writes of the OR (no atomics on a GPU)
    chosen.scatter_(-1, left, chosen.gather(-1, left) | take_left)
    return chosen.scatter_(-1, right, chosen.gather(-1, right) | take_right)


def _positions(chosen: Tensor, kk: int) -> Tensor:
    """Positions (N, C, kk) of the kk set entries of each row of chosen (N, C, T), increasing:
    a prefix count, then a binary search for counts 1..kk."""
    cdt = _count_dtype(chosen.shape[-1])
    cum = chosen.cumsum(-1, dtype=cdt)
    want = torch.arange(1, kk + 1, dtype=cdt, device=chosen.device).expand(cum.shape[:-1] + (kk,))
    return torch.searchsorted(cum, want.contiguous())


def _finish_dense(
    above: Tensor, at: Tensor, need: Tensor, kk: int, s: int, scores: Tensor
) -> Tensor:
    """The selection (N, C, T) bool: `above` and `need` of the tied keys `at` (N, C, T) by the
    chunk's dense float32 `scores`. The need-th best tied score (the cut) comes from a top-k,
    whose entries hold every better tied key; the equal ones go to the nearest (`_nearest`).
    Scores compare as `ordered_bits`, the CPU kernel's order, so that infinite and NaN scores
    are ordered too and never equal an untied key's mark."""
    tied = ordered_bits(scores).masked_fill(~at, -1)  # the tied keys' order, -1 elsewhere
    best, where = tied.topk(kk, dim=-1)  # (N, C, kk)
    cut = best.gather(-1, need - 1)  # (N, C, 1): a tied key's, >= 0
    better = best > cut  # (N, C, kk); the -1 of untied keys never is
    chosen = above.scatter(-1, where, above.gather(-1, where) | better)
    m = need - _count(better)
    return chosen | _nearest(tied == cut, m, s)


def topk_by_match(
    cq: Tensor, ck: Tensor, kv: Tensor, k: int, q: Tensor | None = None, keys: Tensor | None = None
) -> Tensor:
    """Top-k keys per query by number of equal bits, the own key below every other allowed key
    and above the disallowed ones; ties go to the larger score q_i . keys_j (`tie_scores`),
    then the nearer key, then the earlier one (without q and keys, `tie_break="position"`,
    straight to the nearer).

    cq, ck (N, T, K) codes (N = B h): bool sign bits, or integer l2 buckets; kv (N, T) allowed
    keys, q, keys (N, T, d) or None -> (N, T, min(k, T)) key positions, increasing. Off the CPU
    rows go in chunks (by shapes only) that keep the (N, chunk, T) levels within memory.
    """
    N, T, K = cq.shape
    kk = min(k, T)
    by_score = q is not None and keys is not None
    if _use_cpu_kernel(cq):
        if not by_score:
            q = keys = cq.new_empty(N, T, 0, dtype=torch.float32)
        return lsh_topk_cpu(cq, ck, kv, k, widen(q), widen(keys))
    levels = _chunk_levels(cq, ck, kv)
    chunk = max(1, _MATCH_CHUNK // max(1, N * T))
    out = []
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        lvl = levels(s, e)  # (N, C, T)
        cstar = _threshold(lvl, kk, _top_level(K))  # (N, C, 1)
        above, at = lvl > cstar, lvl == cstar  # all selected; tied
        need = kk - _count(above).long()  # (N, C, 1) in [1, kk]: slots for tied keys
        if by_score:
            chosen = _finish_dense(above, at, need, kk, s, tie_scores(q[:, s:e], keys))
        else:
            chosen = above | _nearest(at, need, s)
        out.append(_positions(chosen, kk))
    return torch.cat(out, dim=1)  # (N, T, kk)

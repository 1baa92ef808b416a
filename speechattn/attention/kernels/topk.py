"""LSH's selection kernel: the top-k keys of each query by code match, exact and group-pruned
(`lsh.py`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.base import widen
from speechattn.attention.fp32 import ieee_matmul

# Elements of one (B h, chunk, T) block of match scores. On CPU a cache-sized block is
# fastest; on a GPU each block is ~10 kernel launches, so a block is as large as memory
# allows (about 0.5 GiB per int32 copy of the scores, a few alive at once), which at
# B = 50, h = 12, T = 500 is 2 blocks per layer instead of 84.
_MATCH_CHUNK = 1 << 21
_MATCH_CHUNK_GPU = 1 << 27


def _probe_native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 / AMX). Without it, a
    bfloat16 matmul is emulated and several times slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# probed once at import: a plain bool is a constant to torch.compile (the op is not traceable)
_NATIVE_BF16_CPU = _probe_native_bf16_cpu()


def _native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 natively (tests replace this function)."""
    return _NATIVE_BF16_CPU


def _offset_scores(
    T: int, Tp: int, self_penalty: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """w[u] for the offset j - i = u - (T - 1), u in [0, T + Tp - 1): 2 Tp - rank, integers in
    [1, 2 Tp - 1] larger for nearer keys, then for the earlier of two equidistant ones; the
    self offset 0 gets 2 Tp - self_penalty, which no other offset's score can equal."""
    off = torch.arange(-(T - 1), Tp, device=device)
    rank = 2 * off.abs() + (off > 0).long()
    w = 2 * Tp - rank
    w[T - 1] -= self_penalty
    return w.to(dtype).contiguous()


def _offset_chunk(w: Tensor, T: int, s: int, e: int, S: int, G: int) -> Tensor:
    """w at the offsets of rows s..e-1, keys in grouped order p = r G + g <-> j = g S + r.

    A strided view of w read bottom-up (strides must be positive), then flipped: (C, S G).
    """
    up = w.as_strided((e - s, S, G), (1, 1, S), T - e)  # [a, r, g] = w[T - e + a + r + g S]
    return up.flip(0).reshape(e - s, S * G)


def _group_size(T: int, k: int) -> int:
    """Key group size S for the pruned top-k (minimises T / S + k S); 1 when not worth it."""
    S = 1 << max(2, round(math.log2(math.sqrt(T / k))))
    G = -(-T // S)
    return S if k < G and G + k * S <= T // 2 else 1


def _match_dtype(K: int, device: torch.device) -> torch.dtype:
    """dtype of the +-1 code matmul, exact for its integers (|entries and partial sums| <=
    9 (K + 1), whatever the accumulation): bfloat16 (exact to 256) on CPUs that have it
    natively; on GPUs float16 (exact to 2048; tensor cores), else float64, since float32 may
    run as TF32 there (exact to 2048 only); float32 on other CPUs."""
    if device.type == "cpu":
        return torch.bfloat16 if _native_bf16_cpu() and 9 * (K + 1) <= 256 else torch.float32
    return torch.float16 if 9 * (K + 1) <= 2048 else torch.float64


def ordered_bits(score: Tensor) -> Tensor:
    """Float scores as int64 in [0, 2^32) with the same order: the float32 value's bits,
    negative values' magnitude bits flipped (-0.0 counts as +0.0). Two scores map to the
    same integer only when they are equal in float32."""
    bits = (widen(score).float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long() + (1 << 31)


def topk_by_match(
    cq: Tensor, ck: Tensor, kv: Tensor, k: int, q: Tensor | None = None, keys: Tensor | None = None
) -> Tensor:
    """Top-k keys per query by number of equal bits; the query's own key ranks below every
    other allowed key and above the disallowed ones. Ties in the match count go to the larger
    score q_i . keys_j (compared in float32), and only among equal scores to the nearer key,
    then the earlier one; without q and keys (the `tie_break="position"` option) straight to
    the nearer, then the earlier key.

    cq, ck (N, T, K) bool codes (N = B h), kv (N, T) allowed keys, q, keys (N, T, d) or None.
    Returns (N, T, min(k, T)).

    Composite integer score = (2 match - K - 2 (K + 1) [j = i]) W + tie-break in [0, W) with
    W = 2^32 (2 Tp + 1) (score bits, `ordered_bits`, then position) or W = 2 Tp + 1 (position
    only); all values of a row are distinct. The match part is one batched matmul of +-1
    codes (`_match_dtype`: bfloat16, exact for these small integers, on CPUs with native
    bfloat16, where it is faster than float32) where an extra code column subtracts
    4 (K + 1) from disallowed keys and 8 (K + 1) from the keys padding T up to S G; the
    scores are one more batched matmul per chunk, in true float32 (never TF32: `ieee_matmul`,
    like the match product). The composite is int32 when it fits (top-k
    runs faster on it than on floats), else int64.

    Exact pruning for long rows: keys are split into G groups of S (group g = keys g S + r),
    stored group-strided so that group maxima are elementwise maxima over S contiguous
    slices. The top-k lie in the k groups with the largest maxima (a group holding a top-k
    key has a maximum beaten by fewer than k keys), so each row needs a top-k over G group
    maxima and one over k S candidates instead of one over T. Rows go in chunks so the
    (N, chunk, T) scores stay small: cache-sized on CPU, as large as a memory bound allows on
    GPUs (a few chunks, not thousands of small launches). Chunks depend on shapes only.
    """
    N, T, K = cq.shape
    kk = min(k, T)
    S = _group_size(T, kk)
    G = -(-T // S)
    Tp = G * S
    by_score = q is not None and keys is not None
    M = (2 * Tp + 1) << (32 if by_score else 0)  # above every tie-break value
    if (11 * (K + 1) + 1) * M >= (1 << 63):
        raise ValueError(f"LSH top-k: T={T} with bits={K} overflows the int64 composite score")
    dtype = torch.int32 if (10 * (K + 1) + 1) * M < (1 << 31) else torch.int64
    mdtype = _match_dtype(K, cq.device)
    sq = torch.cat([cq.to(mdtype) * 2 - 1, torch.ones(N, T, 1, dtype=mdtype, device=cq.device)], -1)
    pen = (~kv[..., None]).to(mdtype) * (-4 * (K + 1))  # (N, T, 1)
    sk = torch.cat([ck.to(mdtype) * 2 - 1, pen], dim=-1)  # (N, T, K + 1)
    if Tp > T:
        fake = torch.zeros(N, Tp - T, K + 1, dtype=mdtype, device=cq.device)
        fake[..., -1] = -8 * (K + 1)
        sk = torch.cat([sk, fake], dim=1)  # (N, Tp, K + 1)

    def grouped(t: Tensor) -> Tensor:  # (N, Tp, e) -> (N, e, Tp), key p = r G + g
        return t.view(N, G, S, -1).permute(0, 3, 2, 1).reshape(N, -1, Tp)

    skT = grouped(sk)  # (N, K + 1, Tp)
    if by_score:
        q = widen(q)
        keysT = grouped(F.pad(widen(keys), (0, 0, 0, Tp - T)))  # (N, d, Tp), zeros past T
    budget = _MATCH_CHUNK if cq.device.type == "cpu" else _MATCH_CHUNK_GPU
    chunk = max(1, budget // max(1, N * Tp))
    w = _offset_scores(T, Tp, 2 * (K + 1) * M, dtype, cq.device)
    out = []
    for s in range(0, T, chunk):
        e, C = min(s + chunk, T), min(chunk, T - s)
        score = ieee_matmul(sq[:, s:e], skT).to(dtype).mul_(M)
        score += _offset_chunk(w, T, s, e, S, G)  # (N, C, Tp)
        if by_score:  # the true score's order, above the position's
            score += ordered_bits(ieee_matmul(q[:, s:e], keysT)).mul_(2 * Tp + 1)
        if S == 1:
            out.append(score.topk(kk, dim=-1, sorted=False).indices)
            continue
        blocks = score.view(N, C, S, G)
        groups = blocks.amax(-2).topk(kk, dim=-1, sorted=False).indices  # (N, C, kk)
        cand = blocks.gather(3, groups[:, :, None, :].expand(N, C, S, kk))  # (N, C, S, kk)
        pick = cand.view(N, C, S * kk).topk(kk, dim=-1, sorted=False).indices  # (N, C, kk)
        out.append(groups.gather(-1, pick % kk) * S + pick // kk)
    return torch.cat(out, dim=1)  # (N, T, kk)

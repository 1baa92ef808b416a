"""LSH's selection on the CPU (`topk.py`'s definition), one compiled kernel per layer and a
custom op (torch.compile keeps it as one opaque call); the algorithm in docs/attention.md (LSH),
why numba in docs/development.md. Compiled on first use and cached beside the module (about
15 s once per machine for each of its two builds, `CPUKernel`).
"""

from __future__ import annotations

import types as pytypes
from collections.abc import Callable

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic
from torch import Tensor


class CPUKernel:
    """A numba kernel compiled threaded (`prange` over as many threads as torch uses) and serial,
    for one-thread processes: single-threaded jobs side by side (the tiny study's) were 6x
    slower with idle pool threads waiting on both cores."""

    def __init__(self, fn: Callable, **options: object) -> None:
        self.threaded = njit(parallel=True, cache=True, **options)(fn)
        serial = pytypes.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial")
        serial.__qualname__ = fn.__qualname__ + "_serial"  # its own cache entry
        self.serial = njit(cache=True, **options)(serial)

    def __call__(self, *args: object) -> object:
        threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
        if threads <= 1:
            return self.serial(*args)
        numba.set_num_threads(threads)
        return self.threaded(*args)


def cpu_kernel(**options: object) -> Callable[[Callable], CPUKernel]:
    """Decorator: `CPUKernel(fn, **options)` (numba options, e.g. fastmath)."""
    return lambda fn: CPUKernel(fn, **options)


@intrinsic
def _popcount(typingctx, x):
    """Bits set in an unsigned integer (LLVM's ctpop)."""

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return x(x), codegen


@intrinsic
def _trailing_zeros(typingctx, x):
    """Trailing zero bits of a non-zero uint64 (LLVM's cttz)."""

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return types.uint64(types.uint64), codegen


@intrinsic
def _at_least(typingctx, row, start, c):
    """Bit l set where row[start + l] >= c, l < 64 (row contiguous int16, start + 64 <= its
    size): one vector comparison read back as a mask, 3x faster than numba's bit loop."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        lanes = ir.VectorType(ir.IntType(16), 64)
        at = builder.bitcast(builder.gep(data, [args[1]]), lanes.as_pointer())
        block = builder.load(at, align=2)  # int16 alignment: a vector load assumes its own
        first = builder.insert_element(ir.Constant(lanes, ir.Undefined), args[2], ir.IntType(32)(0))
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64)
        bound = builder.shuffle_vector(first, ir.Constant(lanes, ir.Undefined), zeros)
        return builder.bitcast(builder.icmp_signed(">=", block, bound), ir.IntType(64))

    return types.uint64(row, types.intp, types.int16), codegen


@njit(cache=True)
def _sign_words(codes):
    """Bool codes (N, T, K) -> (ceil(K / 16), 1, N, T) uint16, one plane: bit b of a code in
    word b // 16 (16-bit words: 32 keys per vector; compiled: 1.5-3x faster than tensor ops)."""
    N, T, K = codes.shape
    out = np.zeros(((K + 15) // 16, 1, N, T), np.uint16)
    for n in range(N):
        for t in range(T):
            for b in range(K):
                out[b // 16, 0, n, t] |= np.uint16(codes[n, t, b]) << np.uint16(b % 16)
    return out


@njit(cache=True)
def _pack_planes(cq, ck):
    """Integer codes (N, T, K) of queries and keys -> (ceil(K / 16), P, N, T) uint16 bit planes
    each: hash b's field (its bucket less the keys' lowest) is P bits, bit p in bit b % 16 of
    plane p of group b // 16, so one OR of P XORs and a popcount compare 16 hashes. P holds
    every key's field and one value more, for query buckets outside the keys' span (3 at the
    default bucket width)."""
    N, T, K = ck.shape
    low = np.empty(K, np.int64)
    high = np.empty(K, np.int64)
    for b in range(K):
        low[b] = high[b] = ck[0, 0, b]
    for n in range(N):
        for t in range(T):
            for b in range(K):
                low[b] = min(low[b], ck[n, t, b])
                high[b] = max(high[b], ck[n, t, b])
    span = np.max(high - low)
    P = 1
    while (1 << P) - 1 <= span:
        P += 1
    outside = np.int64((1 << P) - 1)
    G = (K + 15) // 16
    planes = np.empty((2, G, P, N, T), np.uint16)
    fields = np.empty(16, np.int64)  # a key's fields of one group
    for side, codes in enumerate((cq, ck)):
        for n in range(N):
            for t in range(T):
                for g in range(G):
                    hashes = min(16, K - 16 * g)
                    for h in range(hashes):
                        c = np.int64(codes[n, t, 16 * g + h])
                        lo, hi = low[16 * g + h], high[16 * g + h]
                        fields[h] = c - lo if lo <= c <= hi else outside
                    for p in range(P):
                        word = 0
                        for h in range(hashes):
                            word |= (fields[h] >> p & 1) << h
                        planes[side, g, p, n, t] = word
    return planes[0], planes[1]


# lv = start less the hashes of group g on which query i and each key differ (an OR of the
# planes' XORs, a popcount): three functions, as one with three branches ran 5x slower.
@njit(cache=True)
def _one_plane(lv, start, pq, pk, g, n, i):
    """Sign codes: one plane, XOR and popcount."""
    c0, k0 = pq[g, 0, n, i], pk[g, 0, n]
    for j in range(k0.shape[0]):
        lv[j] = start[j] - np.int16(_popcount(c0 ^ k0[j]))


@njit(cache=True)
def _up_to_four_planes(lv, start, pq, pk, g, n, i):
    """2-4 planes in one pass (a repeated plane standing in for an absent one)."""
    P = pq.shape[1]
    p1, p2, p3 = 1, min(2, P - 1), min(3, P - 1)
    c0, c1, c2, c3 = pq[g, 0, n, i], pq[g, p1, n, i], pq[g, p2, n, i], pq[g, p3, n, i]
    k0, k1, k2, k3 = pk[g, 0, n], pk[g, p1, n], pk[g, p2, n], pk[g, p3, n]
    for j in range(k0.shape[0]):
        x = (c0 ^ k0[j]) | (c1 ^ k1[j]) | (c2 ^ k2[j]) | (c3 ^ k3[j])
        lv[j] = start[j] - np.int16(_popcount(x))


@njit(cache=True)
def _many_planes(lv, start, pq, pk, g, n, i, differ):
    """More than 4 planes (l2 buckets spanning more than 14 values, rare): ORed into `differ`
    plane by plane, then counted."""
    differ[:] = 0
    for b in range(pq.shape[1]):
        code, keys_b = pq[g, b, n, i], pk[g, b, n]
        for j in range(keys_b.shape[0]):
            differ[j] |= code ^ keys_b[j]
    for j in range(differ.shape[0]):
        lv[j] = start[j] - np.int16(_popcount(differ[j]))


# Reassociation lets the sum run in vector lanes: the float64 products of float32 values are
# exact, so the order changes only the sum's float64 rounding, which survives the rounding to
# float32 about once in 2^29 scores.
@njit(cache=True, fastmath={"reassoc", "contract"})
def _dot(query, keys, n, j):
    """query (d,) float64 . keys[n, j] (widened) as a float64 sum."""
    s = 0.0
    for e in range(query.shape[0]):
        s += query[e] * np.float64(keys[n, j, e])
    return s


@njit(cache=True)
def _kth_largest(a, n, k):
    """The k-th largest of the n distinct values a[:n] (reordering them: a quickselect)."""
    target, lo, hi = n - k, 0, n - 1
    while lo < hi:
        pivot = a[(lo + hi) // 2]
        i, j = lo, hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while a[j] > pivot:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break
    return a[target]


@njit(cache=True)
def _count4(lv, c):
    """The keys at or above each of the levels c, c - 1, c - 2, c - 3 of a row lv (64 m,) int16."""
    n0 = n1 = n2 = n3 = 0
    for start in range(0, lv.shape[0], 64):
        n0 += np.int64(_popcount(_at_least(lv, start, c)))
        n1 += np.int64(_popcount(_at_least(lv, start, np.int16(c - 1))))
        n2 += np.int64(_popcount(_at_least(lv, start, np.int16(c - 2))))
        n3 += np.int64(_popcount(_at_least(lv, start, np.int16(c - 3))))
    return n0, n1, n2, n3


@njit(cache=True)
def _threshold(lv, kk):
    """c*, the largest level with at least kk keys at or above it, of a row lv (64 m,) int16
    (keys >= 1, padding 0), four levels per pass down from the row's best (nearly always one)."""
    best = lv[0]
    for j in range(lv.shape[0]):
        if lv[j] > best:  # not max(): numba's max widens int16 to int64 lanes
            best = lv[j]
    c = best
    while True:
        counts = _count4(lv, c)
        for drop in range(4):
            if counts[drop] >= kk:
                return np.int16(c - drop)
        c = np.int16(c - 4)


@njit(cache=True, fastmath={"reassoc", "contract"})
def _dot32(query, keys, n, j):
    """query (d,) float32 . keys[n, j] as a float32 sum: an estimate (`_contenders`)."""
    s = np.float32(0)
    for e in range(query.shape[0]):
        s += query[e] * np.float32(keys[n, j, e])
    return s


@njit(cache=True)
def _contenders(query, keys, n, tied, tied_n, need, error, estimate):
    """Narrow the tied keys tied[:tied_n] (increasing), in place, to those whose exact score can
    still place them among the best `need`; returns their number (>= need).

    Estimates (`_dot32`) are within `error` of the exact scores: with `need` estimates >= x
    (bisection), a key estimated below x - 2 error is out. Often exactly `need` stay; a NaN or
    infinite estimate has no bound, and all stay."""
    lo = hi = estimate[0] = _dot32(query, keys, n, tied[0])
    total = np.float32(0)
    for m in range(1, tied_n):
        estimate[m] = _dot32(query, keys, n, tied[m])
        lo, hi = min(lo, estimate[m]), max(hi, estimate[m])
        total += estimate[m]
    if not np.isfinite(total + estimate[0]):  # finite estimates sum to a finite total
        return tied_n
    for _ in range(12):  # count(estimate >= lo) >= need holds throughout
        mid = lo + (hi - lo) / np.float32(2)
        count = 0
        for m in range(tied_n):
            count += estimate[m] >= mid
        if count >= need:
            lo = mid
            if count == need:  # x found: exactly `need` estimates at or above it
                break
        else:
            hi = mid
    cut, kept = lo - np.float32(2 * error), 0
    for m in range(tied_n):
        tied[kept] = tied[m]
        kept += estimate[m] >= cut
    return kept


# Up to this many tied keys, each is ranked by counting the keys that beat it (n^2 comparisons
# in vector lanes); above, by a quickselect (n log n, but mostly mispredicted branches).
RANK_MAX = 128


@cpu_kernel()
def _select(pq, pk, K, allowed, kk, q, keys, by_score, out):
    """pq, pk (G, P, N, T) words of the codes, groups of P bit planes (`_sign_words`,
    `_pack_planes`); allowed (N, T) bool; q, keys (N, T, d) float32 or float64 (scores, when
    by_score); out (N, T, kk) int64: the selected keys of every row, increasing."""
    G, P, N, T = pq.shape
    rows = 16  # rows per task: the per-task buffers are made once per 16 rows
    tasks = (T + rows - 1) // rows
    blocks = (T + 63) // 64
    longest = np.zeros(N)  # each head's largest key norm, which bounds the estimates' error
    if by_score:
        for n in prange(N):
            for j in range(T):
                norm = 0.0
                for e in range(keys.shape[2]):
                    norm += np.float64(keys[n, j, e]) ** 2
                longest[n] = max(longest[n], np.sqrt(norm))
    for task in prange(N * tasks):
        n = task // tasks
        lv = np.zeros(64 * blocks, np.int16)  # the row's levels; padding 0, below every key
        partial = np.zeros(64 * blocks, np.int16)  # the levels after a group, when G > 1
        selected = np.empty(blocks, np.uint64)  # the row's selected keys, a bit each
        top = np.empty(T, np.int16)  # a key's level when it matches in every bit
        tied = np.empty(T, np.int64)
        order = np.empty(T, np.int64)
        scratch = np.empty(T, np.int64)
        score = np.empty(T, np.float32)
        score_bits = score.view(np.int32)
        chosen = np.empty(kk, np.int64)
        query = np.empty(q.shape[2], np.float64)
        query32 = np.empty(q.shape[2], np.float32)
        differ = np.empty(T, pq.dtype)  # a group's hashes on which a key differs, a bit each
        for j in range(T):  # the levels of `topk._chunk_levels`, less the mismatches
            top[j] = 2 * K + 4 if allowed[n, j] else K + 2
        for i in range((task % tasks) * rows, min((task % tasks + 1) * rows, T)):
            start = top
            for g in range(G):  # the last group writes lv; none reads the array it writes
                end = lv if (G - g) % 2 == 1 else partial  # (so its loop runs in vector lanes)
                if P == 1:
                    _one_plane(end, start, pq, pk, g, n, i)
                elif P <= 4:
                    _up_to_four_planes(end, start, pq, pk, g, n, i)
                else:
                    _many_planes(end, start, pq, pk, g, n, i, differ)
                start = end
            lv[i] = K + 3 if allowed[n, i] else 1  # the own key: below the other allowed keys
            c = _threshold(lv, kk)
            above = tied_n = 0  # the keys above c* are in; those at c* (tied), increasing
            for block in range(blocks):
                higher = _at_least(lv, 64 * block, np.int16(c + 1))
                at = _at_least(lv, 64 * block, c) & ~higher
                selected[block] = higher
                above += np.int64(_popcount(higher))
                while at:
                    tied[tied_n] = 64 * block + _trailing_zeros(at)
                    tied_n += 1
                    at &= at - np.uint64(1)
            need = kk - above  # slots for tied keys, in [1, tied_n]
            if tied_n > need and by_score:  # only the contenders need exact scores
                norm = 0.0
                for e in range(q.shape[2]):
                    query[e] = q[n, i, e]
                    query32[e] = np.float32(query[e])
                    norm += query[e] ** 2
                size = np.sqrt(norm) + longest[n]
                bound = np.sqrt(norm) * longest[n]  # >= the sum of |products|
                if size < 1e15:  # (no float32 overflow) the estimate's and the rounding's
                    error = 2 * (q.shape[2] + 4) * 2.0**-24 * bound  # error bound, doubled,
                    error += q.shape[2] * 2.0**-100 * (1 + size) ** 2  # and float32 underflow
                    tied_n = _contenders(query32, keys, n, tied, tied_n, need, error, score)
            if tied_n > need:  # the best `need` by (score, nearer, earlier); all distinct
                for m in range(tied_n):
                    j = tied[m]
                    order[m] = 2 * T - (2 * abs(j - i) + (1 if j > i else 0))  # in [1, 2T]
                if by_score:
                    for m in range(tied_n):  # + 0.0: -0.0 counts as +0.0
                        score[m] = np.float32(_dot(query, keys, n, tied[m])) + np.float32(0)
                    for m in range(tied_n):  # the float32 order as integers (`ordered_bits`)
                        b = np.int64(score_bits[m])  # branch-free: the signs are random
                        b = (b ^ ((b >> 63) & 0x7FFFFFFF)) + (1 << 31)
                        order[m] += b * (2 * T + 1)
                if tied_n <= RANK_MAX:  # a key is in when fewer than `need` keys beat it
                    kept = 0
                    for m in range(tied_n):
                        beaten = 0
                        for o in range(tied_n):
                            beaten += order[o] > order[m]
                        chosen[kept] = tied[m]
                        kept += beaten < need
                else:
                    for m in range(tied_n):
                        scratch[m] = order[m]
                    cut = _kth_largest(scratch, tied_n, need)
                    kept = 0
                    for m in range(tied_n):
                        chosen[kept] = tied[m]
                        kept += order[m] >= cut
            else:
                for m in range(tied_n):
                    chosen[m] = tied[m]
            for m in range(need):
                selected[chosen[m] >> 6] |= np.uint64(1) << np.uint64(chosen[m] & 63)
            p = 0  # the selected keys in increasing order, from their bits
            for block in range(blocks):
                bits = selected[block]
                while bits:
                    out[n, i, p] = 64 * block + _trailing_zeros(bits)
                    p += 1
                    bits &= bits - np.uint64(1)


@torch.library.custom_op("speechattn::lsh_topk_cpu", mutates_args=())
def lsh_topk_cpu(cq: Tensor, ck: Tensor, kv: Tensor, k: int, q: Tensor, keys: Tensor) -> Tensor:
    """cq, ck (N, T, K) codes, bool (sign) or int32 (l2 buckets), kv (N, T) allowed keys, q, keys
    (N, T, d) float32/64, or (N, T, 0) for ties by position -> (N, T, min(k, T)) int64 keys,
    increasing."""
    N, T, K = cq.shape
    out = torch.empty(N, T, min(k, T), dtype=torch.long)
    if N * T == 0:
        return out
    if cq.dtype == torch.bool:
        planes = [_sign_words(c.contiguous().numpy()) for c in (cq, ck)]
    else:
        planes = _pack_planes(cq.contiguous().numpy(), ck.contiguous().numpy())
    # float32 rows widened in the kernel (0.85-0.9x the time: half the bytes), one build per dtype
    q, keys = (t.contiguous().numpy() for t in (q, keys))
    _select(*planes, K, kv.contiguous().numpy(), min(k, T), q, keys, q.shape[-1] > 0, out.numpy())
    return out


@lsh_topk_cpu.register_fake
def _(cq: Tensor, ck: Tensor, kv: Tensor, k: int, q: Tensor, keys: Tensor) -> Tensor:
    N, T, _ = cq.shape
    return cq.new_empty(N, T, min(k, T), dtype=torch.long)

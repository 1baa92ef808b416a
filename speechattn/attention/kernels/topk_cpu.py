"""LSH's selection on the CPU: the top-k keys of each query by code match, ties in the match
count broken by the score, then by position (`lsh.py`), one compiled kernel per layer.

Per query row, in one thread and in cache: the match levels of all T keys (sign codes: XOR and
popcount of the packed bits; l2 codes: equal buckets, hash by hash; the levels of
`topk._chunk_levels`), their maximum, and the threshold c* (the largest level with at least
k keys at or above it: counted four levels per pass down from the maximum, or, where the
previous row had few keys near its best, from the histogram of those keys, collected in one
pass; `_members`); the keys above c* are in, and the keys at c* (tied) get their scores,
float64 sums of the exact products rounded to float32 (`topk.tie_scores`), only when they
outnumber the free slots; the best of them by (score, nearness) fill the slots (each
counted against the others, without branches, or, past `RANK_MAX` of them, a quickselect). The row's keys
come out in increasing order. Nothing of size T x T is ever stored, so memory is
O(T (threads + k)) and the work O(T^2 K / 64) bit operations plus O(T c d) for c tied keys.

Why numba: the selection is a few data-dependent passes over each row; as tensor operations
every pass is a separate sweep over a T x T block in memory (the matmul, the conversion, a
bisection of counts, a nonzero, a sampled product), which on a CPU costs 5-6x this kernel
(`python -m speechattn.bench attention`; docs/benchmarks.md). numba is already installed with
librosa; a kernel compiles on first use and is cached beside the module (`cache=True`, about
15 s once per machine for each of its two builds, `CPUKernel`); it is a custom op, so
torch.compile keeps it as one opaque call. GPUs run the tensor version (`topk.py`).
"""

from __future__ import annotations

import types as pytypes
from collections.abc import Callable

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import intrinsic, overload
from torch import Tensor


class CPUKernel:
    """A numba kernel compiled two ways: threaded (its `prange` loop split across numba's
    threads, as many as torch uses) and serial (`prange` as `range`), for a process that runs
    one thread. The serial one starts no thread pool: single-threaded jobs side by side (the
    tiny study's) were 6x slower with idle pool threads waiting on both cores."""

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
    """Bits set in a uint64 (LLVM's ctpop: one instruction where the CPU has it)."""

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return types.uint64(types.uint64), codegen


def _mismatches(a, b):
    """Hashes on which two words of codes differ (numba only, typed below)."""


@overload(_mismatches)
def _mismatches_typed(a, b):
    if a == types.uint64:  # 64 sign bits
        return lambda a, b: _popcount(a ^ b)
    return lambda a, b: np.uint64(a != b)  # one l2 bucket


@njit(cache=True)
def _pack(codes):
    """Bool codes (N, T, K) -> (ceil(K / 64), N, T) uint64: bit b of a code in word b // 64
    (words first, so that a head's codes of one word are contiguous). Compiled: as tensor
    operations (a widening copy, shifts, a sum, a stack) it took 1.5x as long at K = 16 and 3x
    at K = 100, T = 2048."""
    N, T, K = codes.shape
    out = np.zeros(((K + 63) // 64, N, T), np.uint64)
    for n in range(N):
        for t in range(T):
            for b in range(K):
                out[b // 64, n, t] |= np.uint64(codes[n, t, b]) << np.uint64(b % 64)
    return out


# Reassociation lets the sum run in vector lanes; the products of float32 values (widened to
# float64 before the kernel) are exact in float64, so only the float64 rounding of the sum
# depends on the order, which survives the rounding to float32 about once in 2^29 scores (as
# between any two float64 products).
@njit(cache=True, fastmath={"reassoc", "contract"})
def _dot(q, n, i, keys, j):
    """q[n, i] . keys[n, j] (float64 rows) as a float64 sum."""
    s = 0.0
    for e in range(q.shape[2]):
        s += q[n, i, e] * keys[n, j, e]
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
def _members(lv, kk, found, hist, few):
    """c* (the largest level with at least kk keys at or above it), the number m of those
    keys, written to found[:m] in increasing order, and the number of keys within 3 levels of
    the row's best (`few` for the next row: whether that is under T / 16).

    c* is nearly always within 3 levels of the best. Where those keys are few (`few`, from the
    previous row of the head), one pass collects them (a rarely taken branch, well predicted)
    and their histogram gives c*. Otherwise, or when they are under kk, the keys at or above
    four levels are counted per vectorised pass, down from the best, until a count reaches kk;
    then a compaction (a branch per key when the members are few, else a store per key)."""
    T = lv.shape[0]
    best = lv[0]
    for j in range(T):
        best = max(best, lv[j])
    low = np.int16(max(best - 3, 1))
    c = best
    if few:
        window = 0
        for j in range(T):
            if lv[j] >= low:
                found[window] = j
                window += 1
        if window >= kk:
            hist[low : best + 1] = 0
            for t in range(window):
                hist[lv[found[t]]] += 1
            count = hist[best]
            while count < kk:
                c -= 1
                count += hist[c]
            kept = 0
            for t in range(window):
                j = found[t]
                found[kept] = j
                kept += lv[j] >= c
            return c, kept, window
        c = np.int16(low - 1)  # fewer than kk within 3 levels: count on from below them
    window, m = T, 0
    while m < kk:  # the counts at c, c - 1, c - 2, c - 3
        c1, c2, c3 = np.int16(c - 1), np.int16(c - 2), np.int16(c - 3)
        n0 = n1 = n2 = n3 = 0
        for j in range(T):
            level = lv[j]
            n0 += level >= c
            n1 += level >= c1
            n2 += level >= c2
            n3 += level >= c3
        if c == best:
            window = n3
        for drop, n in enumerate((n0, n1, n2, n3)):
            if n >= kk:
                c, m = np.int16(c - drop), n
                break
        else:
            c = np.int16(c - 4)
    kept = 0
    if 16 * m < T:
        for j in range(T):
            if lv[j] >= c:
                found[kept] = j
                kept += 1
    else:
        for j in range(T):
            found[kept] = j
            kept += lv[j] >= c
    return c, kept, window


# Up to this many tied keys, the chosen ones are found by counting, for each, the keys that beat
# it (n^2 comparisons in vector lanes); above, by a quickselect (n log n, but a mispredicted
# branch for most comparisons of random scores).
RANK_MAX = 128


@cpu_kernel()
def _select(pq, pk, K, allowed, kk, q, keys, by_score, out):
    """pq, pk (W, N, T) words of the codes (`_mismatches`): packed sign bits (uint64, `_pack`)
    or one l2 bucket per word (int16 or int32, W = K); allowed (N, T) bool; q, keys (N, T, d) float64
    (float32 values widened; scores, when by_score); out (N, T, kk) int64: the selected keys of every row,
    increasing."""
    W, N, T = pq.shape
    rows = 16  # rows per task: the per-task buffers are made once per 16 rows
    tasks = (T + rows - 1) // rows
    for task in prange(N * tasks):
        n = task // tasks
        lv = np.empty(T, np.int16)  # the row's levels
        top = np.empty(T, np.int16)  # a key's level when it matches in every bit
        tied = np.empty(T, np.int64)
        order = np.empty(T, np.int64)
        scratch = np.empty(T, np.int64)
        score = np.empty(T, np.float32)
        score_bits = score.view(np.int32)
        chosen = np.empty(kk, np.int64)
        hist = np.empty(2 * K + 5, np.int64)
        few = False  # the previous row had few keys near its best (`_members`)
        for j in range(T):  # the levels of `topk._chunk_levels`, less the mismatches
            top[j] = 2 * K + 4 if allowed[n, j] else K + 2
        for i in range((task % tasks) * rows, min((task % tasks + 1) * rows, T)):
            code, keys_w = pq[0, n, i], pk[0, n]
            for j in range(T):
                lv[j] = top[j] - np.int16(_mismatches(code, keys_w[j]))
            for w in range(1, W):
                code, keys_w = pq[w, n, i], pk[w, n]
                for j in range(T):
                    lv[j] -= np.int16(_mismatches(code, keys_w[j]))
            lv[i] = K + 3 if allowed[n, i] else 1  # the own key: below the other allowed keys
            c, members, window = _members(lv, kk, tied, hist, few)  # keys >= c*, increasing
            few = 16 * window < T
            above = tied_n = 0
            for m in range(members):  # split, without branches (above < kk, tied_n <= m)
                j = tied[m]
                out[n, i, above] = j
                above += lv[j] > c
                tied[tied_n] = j
                tied_n += lv[j] == c
            need = kk - above  # slots for tied keys, >= 1
            if tied_n > need:  # the best `need` by (score, nearer, earlier); all distinct
                for m in range(tied_n):
                    j = tied[m]
                    order[m] = 2 * T - (2 * abs(j - i) + (1 if j > i else 0))  # in [1, 2T]
                if by_score:
                    for m in range(tied_n):  # + 0.0: -0.0 counts as +0.0
                        score[m] = np.float32(_dot(q, n, i, keys, tied[m])) + np.float32(0)
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
            a, b = above - 1, need - 1  # merge the two increasing lists from the back
            for p in range(kk - 1, -1, -1):
                if b < 0 or (a >= 0 and out[n, i, a] > chosen[b]):
                    out[n, i, p] = out[n, i, a]
                    a -= 1
                else:
                    out[n, i, p] = chosen[b]
                    b -= 1


@torch.library.custom_op("speechattn::lsh_topk_cpu", mutates_args=())
def lsh_topk_cpu(cq: Tensor, ck: Tensor, kv: Tensor, k: int, q: Tensor, keys: Tensor) -> Tensor:
    """cq, ck (N, T, K) codes, bool (sign) or int32 (l2 buckets), kv (N, T) allowed keys,
    q, keys (N, T, d) float32/64, or (N, T, 0) to break ties by position alone. Returns
    (N, T, min(k, T)) int64 key positions, increasing along the last dimension."""
    N, T, K = cq.shape
    out = torch.empty(N, T, min(k, T), dtype=torch.long)
    if N * T == 0:
        return out
    if cq.dtype == torch.bool:
        words = [_pack(c.contiguous().numpy()) for c in (cq, ck)]
    else:  # one word per hash, hash-major, as narrow as the buckets allow (int16: twice as
        # many comparisons per vector as int32; bucket ids are small, |a . z| / (M w) + 1)
        fits = all(-(2**15) <= int(c.min()) and int(c.max()) < 2**15 for c in (cq, ck))
        narrow = torch.int16 if fits else torch.int32
        words = [c.to(narrow).permute(2, 0, 1).contiguous().numpy() for c in (cq, ck)]
    kv = kv.contiguous().numpy()
    # float32 values widened once here, so the kernel's products are float64 loads alone
    q, keys = (t.to(torch.float64).contiguous().numpy() for t in (q, keys))
    _select(*words, K, kv, min(k, T), q, keys, q.shape[-1] > 0, out.numpy())
    return out


@lsh_topk_cpu.register_fake
def _(cq: Tensor, ck: Tensor, kv: Tensor, k: int, q: Tensor, keys: Tensor) -> Tensor:
    N, T, _ = cq.shape
    return cq.new_empty(N, T, min(k, T), dtype=torch.long)

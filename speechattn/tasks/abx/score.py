"""ABX error rates of one representation: items, frame distances, DTW, triplets, averaging.

The definition and how it is computed: docs/abx.md (after Libri-light's `eval_ABX`). Items
are sorted by (context, speaker, center), so that every group of items sharing all three is
a contiguous range; contexts are scored one at a time.

Shape letters: I items, U utterances, N 10 ms label frames of all utterances together,
G groups, C cells, F frames of a context's items, D feature dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from speechattn.attention.kernels.topk_cpu import cpu_kernel
from speechattn.errors import require

DISTANCES = ("angular", "cosine")
# frame-distance entries computed per matrix product (row blocks of a large context)
BLOCK_ENTRIES = 1 << 22


@dataclass
class AbxScore:
    """Error rates (fractions; None where no cell exists) and what they average."""

    within: float | None
    across: float | None
    # cells (contexts x center pairs x speakers), triplets and (center, other center) pairs
    cells: dict[str, int] = field(default_factory=dict)
    triplets: dict[str, int] = field(default_factory=dict)
    phone_pairs: dict[str, int] = field(default_factory=dict)


@dataclass
class Items:
    """Triphone items, one row per item (arrays of shape (I,), int64)."""

    utt: np.ndarray  # the utterance's index
    start: np.ndarray  # [start, end): the span in the utterance's 10 ms label frames
    end: np.ndarray
    prev: np.ndarray  # prev, center, next: phone ids
    center: np.ndarray
    next: np.ndarray
    speaker: np.ndarray

    def __len__(self) -> int:
        return len(self.utt)

    def subset(self, keep: np.ndarray) -> Items:
        """The items selected by `keep` (a boolean mask (I,) or indices)."""
        return Items(**{k: v[keep] for k, v in vars(self).items()})


def triphone_items(phones: Sequence[np.ndarray], speakers: Sequence[int]) -> Items:
    """The triphone items of U utterances: `phones[u]` (T_u,) phone ids per 10 ms frame (< 0:
    unlabelled), `speakers[u]` the utterance's speaker. Items come in utterance and time order."""
    lengths = np.array([len(p) for p in phones], dtype=np.int64)  # (U,)
    labels = np.concatenate([np.asarray(p, dtype=np.int64) for p in phones] or [np.zeros(0)])
    utt = np.repeat(np.arange(len(phones)), lengths)  # (N,)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    new_run = np.ones(len(labels), dtype=bool)
    new_run[1:] = (labels[1:] != labels[:-1]) | (utt[1:] != utt[:-1])
    run_start = np.flatnonzero(new_run)  # (R,) first frame of each run
    run_end = np.append(run_start[1:], len(labels)).astype(np.int64)
    run_label, run_utt = labels[run_start], utt[run_start]
    mid = np.arange(1, max(len(run_start) - 1, 1))  # runs with a run on either side
    ok = (
        (
            (run_utt[mid - 1] == run_utt[mid])
            & (run_utt[mid + 1] == run_utt[mid])
            & (run_label[mid - 1] >= 0)
            & (run_label[mid] >= 0)
            & (run_label[mid + 1] >= 0)
        )
        if len(run_start) >= 3
        else np.zeros(0, dtype=bool)
    )
    mid = mid[ok]
    u = run_utt[mid]
    return Items(
        utt=u,
        start=run_start[mid - 1] - offsets[u],
        end=run_end[mid + 1] - offsets[u],
        prev=run_label[mid - 1],
        center=run_label[mid],
        next=run_label[mid + 1],
        speaker=np.asarray(speakers, dtype=np.int64)[u],
    )


def frame_span(
    start: np.ndarray, end: np.ndarray, factor: int, num_frames: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The representation frames [first, stop) of label spans [start, end) (10 ms frames):
    frame j at `factor` x 10 ms belongs to a span when its middle label frame,
    factor j + (factor - 1) // 2, lies in it. `num_frames` (I,): each item's utterance length
    in representation frames, which caps `stop`; stop <= first: an item too short for the rate."""
    middle = (factor - 1) // 2
    first = -((middle - start) // factor)  # ceil((start - middle) / factor), >= 0
    stop = (end - 1 - middle) // factor + 1
    return first, np.minimum(stop, num_frames)


def frame_distances(x: Tensor, y: Tensor, distance: str = "angular") -> np.ndarray:
    """x (R, D), y (C, D) unit rows (float64) -> (R, C) float32 distances: angular,
    arccos(cos) / pi in [0, 1] (Libri-light's), or cosine, 1 - cos in [0, 2]. Equal frames
    must be at distance exactly 0: float64 leaves up to ~1e-15 on the cosine of two equal unit
    rows, which arccos turns into 1e-8, so a cosine within 1e-12 of 1 counts as 1; and float32
    rounding makes two frames' distance independent of the order of the product's sums."""
    cos = (x @ y.T).clamp_(-1.0, 1.0)
    cos[cos > 1.0 - 1e-12] = 1.0
    d = torch.arccos(cos).div_(math.pi) if distance == "angular" else 1.0 - cos
    return d.to(torch.float32).numpy()


def unit_rows(h: Tensor) -> Tensor:
    """h (T, D) -> float64 rows of norm 1 (a zero row stays zero: cosine 0 with any frame)."""
    h = h.double()
    return h / h.norm(dim=1, keepdim=True).clamp_min(1e-30)


@njit(cache=True)
def _better(cost, steps, best, k):
    """Whether a predecessor (cost, steps) beats (best, k): cheaper, or as cheap and shorter."""
    return cost < best or (cost == best and steps < k)


@njit(cache=True)
def _dtw(dist, r0, c0, n, m, cost, steps):
    """DTW of frames r0..r0+n-1 (rows of `dist`) against c0..c0+m-1 (columns): the path's
    summed distance divided by its length. Steps (1, 0), (0, 1), (1, 1); among the optimal
    paths the shortest, which makes it symmetric. cost (2, m) float64 and steps (2, m) int64
    are scratch rows."""
    for a in range(n):
        cur = a & 1
        prv = 1 - cur
        for b in range(m):
            best, k = 0.0, 0
            if a > 0 or b > 0:
                best = np.inf
                if a > 0:
                    best, k = cost[prv, b], steps[prv, b]
                if b > 0 and _better(cost[cur, b - 1], steps[cur, b - 1], best, k):
                    best, k = cost[cur, b - 1], steps[cur, b - 1]
                if a > 0 and b > 0 and _better(cost[prv, b - 1], steps[prv, b - 1], best, k):
                    best, k = cost[prv, b - 1], steps[prv, b - 1]
            cost[cur, b] = best + dist[r0 + a, c0 + b]
            steps[cur, b] = k + 1
    last = (n - 1) & 1
    return cost[last, m - 1] / steps[last, m - 1]


@cpu_kernel()
def _dtw_rows(dist, i0, i1, row0, col0, length, out):
    """out[i, j] = out[j, i] = DTW(item i, item j) for rows i in [i0, i1) and j > i; dist
    (R, F) holds the frames of items i0..i1-1 (row0[i] their first row) against all the
    context's frames (col0[j] its first column); length (n,) frames per item."""
    n = len(length)
    width = length.max()
    for i in prange(i0, i1):
        cost = np.empty((2, width))
        steps = np.empty((2, width), np.int64)
        for j in range(i + 1, n):
            d = _dtw(dist, row0[i], col0[j], length[i], length[j], cost, steps)
            out[i, j] = d
            out[j, i] = d


@njit(cache=True)
def _errors(dist, a0, a1, b0, b1, x0, x1):
    """Summed triplet errors over A in [a0, a1), B in [b0, b1), X in [x0, x1), A != X
    (1 when d(A, X) > d(B, X), 1/2 when equal)."""
    total = 0.0
    for x in range(x0, x1):
        for a in range(a0, a1):
            if a == x:
                continue
            dax = dist[x, a]
            for b in range(b0, b1):
                dbx = dist[x, b]
                if dax > dbx:
                    total += 1.0
                elif dax == dbx:
                    total += 0.5
    return total


@cpu_kernel()
def _cells(
    dist,
    g0,
    g1,
    speaker_lo,
    speaker_hi,
    center_order,
    center_lo,
    center_hi,
    speaker,
    within_at,
    within,
    across_at,
    across,
):
    """The cells of one context's groups (item ranges [g0, g1), sorted by speaker then
    center): for group A and each other group B of its speaker, the within cell (A with at
    least two items), then one across cell per group X of A's center and another speaker
    (`center_order[center_lo[g]:center_hi[g]]` are the groups of g's center). Rows written:
    within (.., 3) = (B, summed errors, triplets) at within_at[A]; across (.., 4) = (B, X,
    summed errors, triplets) at across_at[A]."""
    for ga in prange(len(g0)):
        na = g1[ga] - g0[ga]
        w, c = within_at[ga], across_at[ga]
        for gb in range(speaker_lo[ga], speaker_hi[ga]):
            if gb == ga:
                continue
            nb = g1[gb] - g0[gb]
            if na >= 2:
                within[w, 0] = gb
                within[w, 1] = _errors(dist, g0[ga], g1[ga], g0[gb], g1[gb], g0[ga], g1[ga])
                within[w, 2] = na * (na - 1) * nb
                w += 1
            for p in range(center_lo[ga], center_hi[ga]):
                gx = center_order[p]
                if speaker[gx] == speaker[ga]:
                    continue
                across[c, 0] = gb
                across[c, 1] = gx
                across[c, 2] = _errors(dist, g0[ga], g1[ga], g0[gb], g1[gb], g0[gx], g1[gx])
                across[c, 3] = na * nb * (g1[gx] - g0[gx])
                c += 1


def _runs(*keys: np.ndarray) -> np.ndarray:
    """Start indices of the runs of equal rows in sorted `keys` (each (N,)), plus N at the end."""
    n = len(keys[0])
    change = np.zeros(n, dtype=bool)
    change[:1] = True
    for k in keys:
        change[1:] |= k[1:] != k[:-1]
    return np.append(np.flatnonzero(change), n)


def _mean_by(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """keys (N, k) int, values (N,) -> the distinct key rows (M, k) and the mean of each's values."""
    unique, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return unique, np.bincount(inverse, values) / np.bincount(inverse)


def average(cells: np.ndarray) -> tuple[float | None, int]:
    """Libri-light's averaging (docs/abx.md) of cells (C, 6) rows (context, speaker, center,
    other center, X speaker, error) -> (error, center pairs); (None, 0) without cells."""
    if len(cells) == 0:
        return None, 0
    keys = cells[:, :5].astype(np.int64)
    per_speaker, err = _mean_by(keys[:, 1:4], cells[:, 5])  # (speaker, a, b): over contexts (+ X)
    pairs, err = _mean_by(per_speaker[:, 1:3], err)  # (a, b): over speakers
    return float(err.mean()), len(pairs)


def abx_score(
    features: Tensor,
    offsets: np.ndarray,
    items: Items,
    first: np.ndarray,
    stop: np.ndarray,
    distance: str = "angular",
) -> AbxScore:
    """Within- and across-speaker ABX error of one representation. features (T, D): every
    utterance's frames, utterance u at rows offsets[u]:offsets[u+1]; items (I,) with their
    frames [first, stop) in their utterance (non-empty, `frame_span`)."""
    require(distance in DISTANCES, "distance", distance, f"one of {', '.join(DISTANCES)}")
    unit = unit_rows(features)
    context = items.prev * (items.next.max(initial=0) + 1) + items.next
    order = np.lexsort((items.start, items.utt, items.center, items.speaker, context))
    context, speaker, center = context[order], items.speaker[order], items.center[order]
    begin = (offsets[items.utt] + first)[order]  # (I,) first row of each item in `features`
    length = (stop - first)[order]
    groups = _runs(context, speaker, center)  # item ranges of (context, speaker, center)
    g_context, g_speaker, g_center = (k[groups[:-1]] for k in (context, speaker, center))
    contexts = _runs(g_context)  # group ranges of each context
    found: dict[str, list[np.ndarray]] = {"within": [], "across": []}
    triplets = {"within": 0, "across": 0}
    for c0, c1 in zip(contexts[:-1], contexts[1:], strict=True):
        if len(np.unique(g_center[c0:c1])) < 2:
            continue  # one center: no B for any A
        i0, i1 = groups[c0], groups[c1]
        dist = _context_distances(unit, begin[i0:i1], length[i0:i1], distance)
        g0, g1 = groups[c0:c1] - i0, groups[c0 + 1 : c1 + 1] - i0
        spk, cen = g_speaker[c0:c1], g_center[c0:c1]
        speaker_runs = _runs(spk)
        which = np.searchsorted(speaker_runs, np.arange(c1 - c0), side="right") - 1
        speaker_lo, speaker_hi = speaker_runs[which], speaker_runs[which + 1]
        center_order = np.lexsort((spk, cen))
        center_runs = _runs(cen[center_order])
        where = np.empty(c1 - c0, dtype=np.int64)
        where[center_order] = np.searchsorted(center_runs, np.arange(c1 - c0), side="right") - 1
        center_lo, center_hi = center_runs[where], center_runs[where + 1]
        others = speaker_hi - speaker_lo - 1  # groups B per group A
        n_within = np.where(g1 - g0 >= 2, others, 0)
        n_across = others * (center_hi - center_lo - 1)
        within = np.zeros((int(n_within.sum()), 3))
        across = np.zeros((int(n_across.sum()), 4))
        _cells(
            dist,
            g0,
            g1,
            speaker_lo,
            speaker_hi,
            center_order,
            center_lo,
            center_hi,
            spk,
            np.cumsum(n_within) - n_within,
            within,
            np.cumsum(n_across) - n_across,
            across,
        )
        ga = np.repeat(np.arange(c1 - c0), n_within)
        gb = within[:, 0].astype(np.int64)
        found["within"].append(
            np.stack(
                [
                    g_context[c0 + ga],
                    spk[ga],
                    cen[ga],
                    cen[gb],
                    spk[ga],
                    within[:, 1] / within[:, 2],
                ],
                1,
            )
        )
        ga = np.repeat(np.arange(c1 - c0), n_across)
        gb, gx = across[:, 0].astype(np.int64), across[:, 1].astype(np.int64)
        found["across"].append(
            np.stack(
                [
                    g_context[c0 + ga],
                    spk[ga],
                    cen[ga],
                    cen[gb],
                    spk[gx],
                    across[:, 2] / across[:, 3],
                ],
                1,
            )
        )
        triplets["within"] += int(within[:, 2].sum())
        triplets["across"] += int(across[:, 3].sum())
    score = AbxScore(None, None, triplets=triplets)
    for mode, parts in found.items():
        cells = np.concatenate(parts) if parts else np.zeros((0, 6))
        error, pairs = average(cells)
        setattr(score, mode, error)
        score.cells[mode], score.phone_pairs[mode] = len(cells), pairs
    return score


def _context_distances(
    unit: Tensor, begin: np.ndarray, length: np.ndarray, distance: str
) -> np.ndarray:
    """(n, n) DTW distances of one context's n items (item k: `length[k]` frames of `unit`
    from row `begin[k]`), computed in row blocks of about BLOCK_ENTRIES frame distances."""
    starts = np.repeat(begin - np.cumsum(length) + length, length)
    frames = unit[torch.from_numpy(starts + np.arange(int(length.sum())))]  # (F, D)
    col0 = np.cumsum(length) - length  # each item's first frame in `frames`
    out = np.zeros((len(length), len(length)))
    i0 = 0
    while i0 < len(length):  # rows of items i0..i1-1 against every frame of the context
        budget = max(1, BLOCK_ENTRIES // len(frames))
        i1 = max(i0 + 1, int(np.searchsorted(col0 + length, col0[i0] + budget, side="right")))
        dist = frame_distances(frames[col0[i0] : col0[i1 - 1] + length[i1 - 1]], frames, distance)
        _dtw_rows(dist, i0, i1, col0 - col0[i0], col0, length, out)
        i0 = i1
    return out

"""(Asymmetric) LSH attention for maximum inner product search: `sign_alsh`, `xbox`,
`xbox_qnf`, `simple_lsh`, `simple_alsh`.

* sign_alsh: Shrivastava & Li, "Improved Asymmetric Locality Sensitive Hashing (ALSH) for
  Maximum Inner Product Search (MIPS)", UAI 2015. m = 2, U = 0.75.
* xbox: Bachrach et al., "Speeding Up the Xbox Recommender System Using a Euclidean
  Transformation for Inner-Product Spaces", RecSys 2014.
* xbox_qnf: XBOX with "query normalized first", Huang et al., "Accurate and Fast Asymmetric
  Locality-Sensitive Hashing Scheme for Maximum Inner Product Search", KDD 2018.
* simple_lsh / simple_alsh: Neyshabur & Srebro, "On Symmetric and Asymmetric LSHs for Inner
  Product Search", ICML 2015.

Common scheme (the study, section 2.2): one shared projection gives the shared vectors q (as
in `shared_qk`) and v. Hashing: per sequence and head, M = max ||q_j|| over valid frames; the
shared vectors are transformed with P as keys and with Q as queries (the MIPS transforms need
their norms, so they hash q_j itself) and hashed by K sign random projections (one fixed
seeded matrix per module, a registered buffer, identical at train and inference, seeded from
the `seed` option and the layer index so that unshared layers hash differently). match_ij =
number of equal bits. Each query keeps its top-k other keys by match. Ties in the match count
(frequent: at k = 32 and 16 bits about 40 % of the selected keys are chosen among ties) go to
the larger score q_i k_j, and only among exactly equal scores (in float32) to the nearer key,
then the earlier one (`tie_break="score"`; "position" sends every tie to the nearer key, the
study's first runs, which gave LSH a hidden local window: mean |i - j| of the selected keys 80
instead of 100 at T = 300 on random inputs). The softmax runs over those k only, on
`shared_qk`'s scores q_i k_j / sqrt(d_k) with the L2-normalised keys k_j = q_j / ||q_j||
(`normalize_keys=True`; False scores the raw q_i q_j, the study's first runs), so LSH with
k >= T is `shared_qk` exactly. As in `shared_qk`, a query attends to itself only when it has
no other valid key: it is ranked below every other valid key and its score carries the -5e4
self penalty, so a query with n valid keys gives nonzero weight to exactly min(k, n - 1) of
them (to itself when n = 1).

Under sign projections the bits are invariant to positive scaling, so xbox, xbox_qnf and
simple_lsh give identical codes, as do Sign-ALSH with and without QNF (tested; they would
differ only under an L2 / E2LSH hash, which is not implemented).

Cost: hashing O(T K D); matching O(T^2 K h) as one matmul of +-1 codes (and O(T^2 D) for
the tie-breaking scores, `tie_break="score"`) plus an exact group-pruned top-k, chunked over queries so memory stays O(chunk T); attention on the selected
keys: up to `short_path_max_t` frames one all-pairs SDPA call masked to them, above that
O(T k D) as sparse (CSR) products (float32 under autocast; a custom op, so torch.compile
keeps it in its graph).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speechattn.attention.base import (
    SELF_PENALTY,
    Attention,
    AttentionConfig,
    Flops,
    all_valid,
    key_mask,
    layer_seed,
    linear_flops,
    masked_softmax,
    needs_static_shapes,
    scale,
    widen,
)
from speechattn.attention.registry import register

Transform = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
_TINY = 1e-12
# Elements of one (B h, chunk, T) block of match scores. On CPU a cache-sized block is
# fastest; on a GPU each block is ~10 kernel launches, so a block is as large as memory
# allows (about 0.5 GiB per int32 copy of the scores, a few alive at once), which at
# B = 50, h = 12, T = 500 is 2 blocks per layer instead of 84.
_MATCH_CHUNK = 1 << 21
_MATCH_CHUNK_GPU = 1 << 27


def _probe_native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 / AMX). Without it, a
    bfloat16 matmul is emulated and 7-11x slower than float32 (measured on an AVX2 EPYC)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# probed once at import: a plain bool is a constant to torch.compile (the op is not traceable)
_NATIVE_BF16_CPU = _probe_native_bf16_cpu()


def _native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 natively (tests replace this function)."""
    return _NATIVE_BF16_CPU


# ------------------------------------------------------------------ transforms Q(q), P(k)
# q, k (..., T, d_k); M (..., 1, 1) max valid key norm. Return (Q(q), P(k)), (..., T, d_k + m).
def _unit(q: Tensor) -> Tensor:
    return q / q.norm(dim=-1, keepdim=True).clamp_min(_TINY)


def _sq_norm(x: Tensor) -> Tensor:
    return x.pow(2).sum(-1, keepdim=True)


def sign_alsh(
    q: Tensor, k: Tensor, M: Tensor, qnf: bool = False, U: float = 0.75
) -> tuple[Tensor, Tensor]:
    """P(x) = [x; 1/2 - ||x||^2; 1/2 - ||x||^4], x = k U / M; Q(q) = [q/||q||; 0; 0] (m = 2).

    qnf=True uses Q(q) = [M q/||q||; 0; 0] (query normalised first), same sign codes.
    """
    x = k * (U / M)
    n2 = _sq_norm(x)
    P = torch.cat([x, 0.5 - n2, 0.5 - n2.pow(2)], dim=-1)
    return F.pad(_unit(q) * (M if qnf else 1.0), (0, 2)), P


def xbox(q: Tensor, k: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """P(x) = [x; sqrt(M^2 - ||x||^2)]; Q(q) = [q; 0]."""
    P = torch.cat([k, (M.pow(2) - _sq_norm(k)).clamp_min(0).sqrt()], dim=-1)
    return F.pad(q, (0, 1)), P


def xbox_qnf(q: Tensor, k: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """XBOX keys; Q(q) = [M q/||q||; 0] (query normalised first)."""
    _, P = xbox(q, k, M)
    return F.pad(_unit(q) * M, (0, 1)), P


def simple_lsh(q: Tensor, k: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """x = k / M; P(x) = [x; sqrt(1 - ||x||^2)]; Q(q) = [q/||q||; 0]."""
    x = k / M
    P = torch.cat([x, (1 - _sq_norm(x)).clamp_min(0).sqrt()], dim=-1)
    return F.pad(_unit(q), (0, 1)), P


def simple_alsh(q: Tensor, k: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """x = k / M, y = q / M (unit ball); P(x) = [x; sqrt(1-||x||^2); 0]; Q(y) = [y; 0; sqrt(1-||y||^2)]."""
    x, y = k / M, q / M
    P = torch.cat([x, (1 - _sq_norm(x)).clamp_min(0).sqrt(), torch.zeros_like(x[..., :1])], dim=-1)
    Qq = torch.cat([y, torch.zeros_like(y[..., :1]), (1 - _sq_norm(y)).clamp_min(0).sqrt()], dim=-1)
    return Qq, P


def sign_codes(z: Tensor, projection: Tensor) -> Tensor:
    """Sign random projection bits: z (..., T, d) @ projection (d, K) > 0 -> (..., T, K) bool."""
    return (z @ projection.to(z.dtype)) > 0


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
    bfloat16, where it is about 3x faster than float32) where an extra code column subtracts
    4 (K + 1) from disallowed keys and 8 (K + 1) from the keys padding T up to S G; the
    scores are one more batched matmul per chunk. The composite is int32 when it fits (top-k
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
        score = torch.bmm(sq[:, s:e], skT).to(dtype).mul_(M)
        score += _offset_chunk(w, T, s, e, S, G)  # (N, C, Tp)
        if by_score:  # the true score's order, above the position's
            score += ordered_bits(torch.bmm(q[:, s:e], keysT)).mul_(2 * Tp + 1)
        if S == 1:
            out.append(score.topk(kk, dim=-1, sorted=False).indices)
            continue
        blocks = score.view(N, C, S, G)
        groups = blocks.amax(-2).topk(kk, dim=-1, sorted=False).indices  # (N, C, kk)
        cand = blocks.gather(3, groups[:, :, None, :].expand(N, C, S, kk))  # (N, C, S, kk)
        pick = cand.view(N, C, S * kk).topk(kk, dim=-1, sorted=False).indices  # (N, C, kk)
        out.append(groups.gather(-1, pick % kk) * S + pick // kk)
    return torch.cat(out, dim=1)  # (N, T, kk)


def _csr(crow: Tensor, col: Tensor, values: Tensor) -> Tensor:
    """A square CSR matrix of len(crow) - 1 rows."""
    n = crow.shape[0] - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(crow, col, values, (n, n))


# Softmax attention over each query's selected keys as sparse (CSR) products, a custom op:
# torch.compile keeps it in the graph as one opaque call (sparse tensors cannot be traced),
# and its fake implementations give shapes on fake/meta tensors.
@torch.library.custom_op("speechattn::topk_attention", mutates_args=())
def _topk_attention(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (N, T, d) float32/64, idx (N, T, kk), allowed (N, T, kk) -> out (N, T, d),
    weights p (N T kk,) and CSR columns col (N T kk,) (saved for the backward)."""
    N, T, d = q.shape
    kk = idx.shape[-1]
    with torch.autocast(q.device.type, enabled=False):  # sparse kernels: float32/64 only
        idx, order = idx.sort(dim=-1)  # CSR columns in increasing order
        allowed = allowed.gather(-1, order)
        crow = torch.arange(N * T + 1, device=q.device) * kk
        col = (idx + torch.arange(N, device=q.device).view(N, 1, 1) * T).view(-1)  # (N T kk)
        q, k, v = q.reshape(N * T, d), k.reshape(N * T, d), v.reshape(N * T, d)
        pattern = _csr(crow, col, q.new_ones(col.shape))
        sc = torch.sparse.sampled_addmm(pattern, q, k.T, beta=0.0, alpha=scale).values()
        own = idx == torch.arange(T, device=q.device)[:, None]  # (N, T, kk)
        sc = sc.view(N, T, kk) + own.to(q.dtype) * SELF_PENALTY
        p = masked_softmax(sc, allowed).reshape(-1)  # (N T kk)
        out = _csr(crow, col, p) @ v  # (N T, d)
    return out.view(N, T, d), p, col


@_topk_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor, scale: float):
    n = idx.numel()
    return torch.empty_like(q), q.new_empty(n), idx.new_empty(n, dtype=torch.long)


def key_pointers(col: Tensor, by_key: Tensor, n: int, count: bool) -> Tensor:
    """Row pointers (n + 1,) of the transposed pattern: entries with key < j, for j = 0..n.

    col (nnz,) keys of the entries, by_key (nnz,) their stable order by key. count=True
    (CPU, fastest there): a bincount; its output size depends on the largest key, which a GPU
    must read back (a sync), so elsewhere a binary search of the sorted keys, sized by n."""
    if count:
        return F.pad(torch.bincount(col, minlength=n).cumsum(0), (1, 0))
    return torch.searchsorted(col[by_key], torch.arange(n + 1, device=col.device))


@torch.library.custom_op("speechattn::topk_attention_backward", mutates_args=())
def _topk_attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, p: Tensor, col: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dL/dq, dL/dk, dL/dv (N, T, d) of `_topk_attention` from dL/dout (N, T, d)."""
    shape = q.shape
    N, T, d = shape
    kk = col.shape[0] // (N * T)
    with torch.autocast(q.device.type, enabled=False):
        grad, q, k, v, out = (t.reshape(N * T, d) for t in (grad, q, k, v, out))
        crow = torch.arange(N * T + 1, device=q.device) * kk
        pattern = _csr(crow, col, torch.ones_like(p))
        g_p = torch.sparse.sampled_addmm(pattern, grad, v.T, beta=0.0).values().view(-1, kk)
        delta = (grad * out).sum(-1, keepdim=True)  # (N T, 1)
        g_s = ((g_p - delta) * p.view(-1, kk) * scale).view(-1)  # dL/dscores
        # the transpose: entries by key, a key's queries in increasing order (stable sort)
        by_key = col.to(torch.int32).argsort(stable=True)  # int32: sorts about 2x faster
        crow_t = key_pointers(col, by_key, N * T, count=q.device.type == "cpu")
        query = by_key // kk  # the row (query) of each entry, in key order
        g_q = _csr(crow, col, g_s) @ k
        g_k = _csr(crow_t, query, g_s[by_key]) @ q
        g_v = _csr(crow_t, query, p[by_key]) @ grad
    return g_q.view(shape), g_k.view(shape), g_v.view(shape)


@_topk_attention_backward.register_fake
def _(grad, q, k, v, out, p, col, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _topk_attention_setup(ctx, inputs, output) -> None:
    q, k, v, _, _, scale = inputs
    out, p, col = output
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, out, p, col)


def _topk_attention_grad(ctx, grad: Tensor, _p: Tensor | None, _col: Tensor | None):
    q, k, v, out, p, col = ctx.saved_tensors
    g_q, g_k, g_v = _topk_attention_backward(grad.contiguous(), q, k, v, out, p, col, ctx.scale)
    return g_q, g_k, g_v, None, None, None


_topk_attention.register_autograd(_topk_attention_grad, setup_context=_topk_attention_setup)


def sparse_topk_attention(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor, scale: float
) -> Tensor:
    """Softmax attention of each query over its own selected keys, as sparse matrix products.

    q, k, v (N, T, d_k), idx (N, T, kk) selected key positions (distinct per row), allowed
    (N, T, kk) bool, scale float -> (N, T, d_k) in q's dtype.

    Runs in float32 (float64 stays float64) with autocast off, whatever the input dtype (the
    sparse kernels have no half-precision CPU implementation; explicit casts, so CUDA
    autocast needs no declaration); gradients come back in the inputs' dtypes through the
    casts. The N heads' patterns lie along the diagonal of one (N T, N T) CSR matrix (no
    batched CSR product on CPU; one matrix instead of a loop over heads). Scores q_i k_j *
    scale (+ the self penalty where j = i) are an SDDMM (`torch.sparse.sampled_addmm`) on
    that pattern; outputs and gradients are CSR x dense products. dK and dV take the
    pattern's transpose, built once in the backward by a stable sort of the keys
    (transposing each head's CSR matrix took 30 of the 41 ms of forward and backward at T =
    1024); its row pointers come from the sorted keys, so no size depends on data. Nothing of
    size T x T or T x kk x d_k is formed: memory O(T kk + T d_k), time O(T kk d_k).
    """
    out, _, _ = _topk_attention(widen(q), widen(k), widen(v), idx, allowed, scale)
    return out.to(q.dtype)


@dataclass
class LSHConfig(AttentionConfig):
    k: int = 32  # keys kept per query (top-k by matching bits)
    bits: int = 16  # K, sign random projections per code
    seed: int = 0  # with the layer index, seeds the fixed projection matrix
    # Scores q_i . k_j / sqrt(d_k) with shared_qk's keys k_j = q_j / ||q_j|| (True), so that
    # k >= T is `shared_qk` exactly; False scores the raw shared vectors q_i . q_j (the
    # definition of the study's first runs).
    normalize_keys: bool = True
    # Among keys with equal match counts: "score", the larger score (then the nearer, then the
    # earlier key, on exactly equal scores); "position", the nearer, then the earlier key (the
    # study's first runs: a hidden local window, since ties are frequent).
    tie_break: str = "score"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.k < 1 or self.bits < 1:
            raise ValueError(f"need k >= 1 and bits >= 1, got k={self.k}, bits={self.bits}")
        if self.tie_break not in ("score", "position"):
            raise ValueError(f"LSH tie_break must be 'score' or 'position', got {self.tie_break!r}")


class _LSHAttention(Attention):
    """Shared-QK attention restricted to the top-k keys of an (A)LSH code match."""

    Config = LSHConfig
    transform: ClassVar[Transform]
    extra_dims: ClassVar[int]  # m, dimensions added by the transforms
    complexity_training = (
        "O(T k D) attention + O(T K D) hashing + O(T^2 (K h + D)) code matching and tie-break"
    )
    complexity_inference = complexity_training
    # All-pairs SDPA masked to the selection up to here, CSR products above. Speed over
    # `full`'s on CPU (interleaved medians), all pairs / CSR: 1.04-1.05 / 0.94 at T = 128,
    # 1.00-1.01 / 0.98-1.00 at 256, 0.98 / 1.02 at 320, 0.93 / 1.15 at 512, 0.81 / 1.34 at 1024.
    short_path_max_t = 256

    def __init__(self, config: LSHConfig) -> None:
        super().__init__(config)
        self.k, self.bits = config.k, config.bits
        self.normalize_keys, self.tie_break = config.normalize_keys, config.tie_break
        self.qv = nn.Linear(config.dim, 2 * config.dim, bias=config.bias)  # W^Q (= W^K) | W^V
        gen = torch.Generator().manual_seed(layer_seed(config.seed, config.layer))
        proj = torch.randn(config.head_dim + self.extra_dims, config.bits, generator=gen)
        self.register_buffer("projection", proj)  # (d_k + m, K), fixed, saved with the model

    def keys_attended(self, T: int) -> float:
        return float(min(self.k, T))

    def flops(self, T: int) -> Flops:
        D, E, h, K = self.dim, self.inner_dim, self.num_heads, self.bits
        attention = 2 * 2.0 * T * min(self.k, T) * E  # scores and weighted sums, top-k keys
        hashing = 2 * linear_flops(T, self.head_dim + self.extra_dims, K) * h  # Q(q), P(k)
        matching = 2.0 * T * T * (K + 1) * h  # +-1 code products (and the validity column)
        if self.tie_break == "score":
            matching += 2.0 * T * T * E  # the scores that break ties, all pairs
        return Flops(
            linear_flops(T, D, 2 * E) + attention + self.output_flops(T), hashing + matching
        )

    def _remove_heads(self, index: Tensor) -> None:
        # the projection matrix is per layer, the same for every head: it stays
        self._remove_projection_heads(self.qv, index, blocks=2)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q, k, v (B, h, T, d_k): k = q / ||q|| (`normalize_keys`) or q."""
        q, v = self.qv(x).chunk(2, dim=-1)  # 2 x (B, T, D)
        q = self.split_heads(q)  # (B, h, T, d_k)
        return q, F.normalize(q, dim=-1) if self.normalize_keys else q, self.split_heads(v)

    @torch.no_grad()
    def codes(self, q: Tensor, k: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Query and key codes (B, h, T, K) bool; M over the valid keys of each sequence/head.

        Always computed in float32 with autocast off: a sign bit is a hard decision, and half
        precision transforms (norms, sqrt(M^2 - ||x||^2)) would flip bits of the fp32 model.
        """
        with torch.autocast(q.device.type, enabled=False):
            return self._codes(widen(q), widen(k), valid)

    def _codes(self, q: Tensor, k: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        kv = key_mask(valid)[:, None, :, None]  # (B, 1, T, 1)
        M = (k.norm(dim=-1, keepdim=True) * kv).amax(dim=-2, keepdim=True).clamp_min(_TINY)
        Qq, Pk = type(self).transform(q, k, M)  # (B, h, T, d_k + m)
        return sign_codes(Qq, self.projection), sign_codes(Pk, self.projection)

    @torch.no_grad()
    def select(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Top-k key indices (B, h, T, min(k, T)) (fast path; no gradient).

        q, k (B, h, T, d_k) as `_qkv` gives them: the codes hash the shared vectors q (the
        MIPS transforms need their norms); ties are broken by the scores q . k."""
        B, h, T, d = q.shape
        cq, ck = self.codes(q, q, valid)
        kv = key_mask(valid)[:, None].expand(B, h, T).reshape(B * h, T)
        q_, k_ = (q.reshape(B * h, T, d), k.reshape(B * h, T, d))
        if self.tie_break == "position":
            q_ = k_ = None
        with torch.autocast(q.device.type, enabled=False):  # exact integer match counts
            idx = topk_by_match(
                cq.reshape(B * h, T, -1), ck.reshape(B * h, T, -1), kv, self.k, q_, k_
            )
        return idx.view(B, h, T, -1)

    @torch.no_grad()
    def selection_dense(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Reference selection (B, h, T, T) bool from explicit match counts and a sort."""
        B, h, T, _ = q.shape
        cq, ck = self.codes(q, q, valid)
        match = (cq[:, :, :, None, :] == ck[:, :, None, :, :]).sum(-1)  # (B, h, T, T)
        i = torch.arange(T, device=q.device)
        rank = 2 * (i[:, None] - i[None, :]).abs() + (i[None, :] > i[:, None]).long()  # (T, T)
        # The match count first: self sits below the other valid keys, every disallowed key
        # below self; then the score (its float32 order, `ordered_bits`), then the position.
        own = torch.eye(T, dtype=torch.long, device=q.device) * (self.bits + 1)
        disallowed = (~key_mask(valid))[:, None, None, :] * (2 * self.bits + 4)
        tie, above = 2 * T - rank, 2 * T + 1  # (T, T) in [1, 2T], and a bound above it
        if self.tie_break == "score":
            with torch.autocast(q.device.type, enabled=False):
                s = widen(q) @ widen(k).transpose(-1, -2)  # (B, h, T, T), the order of scores
            tie, above = ordered_bits(s) * above + tie, above << 32
        key = (match - own - disallowed) * above + tie
        order = key.argsort(dim=-1, descending=True)[..., : min(self.k, T)]
        return torch.zeros_like(match, dtype=torch.bool).scatter(-1, order, True)

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        padded = valid is not None
        valid = all_valid(x) if valid is None else valid
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        B, h, T, d = q.shape
        idx = self.select(q, k, valid)  # (B, h, T, kk)
        if self.use_short_path(q):
            return self._attend_short(q, k, v, idx, valid if padded else None)
        allowed = key_mask(valid).gather(1, idx.reshape(B, -1)).view(idx.shape)
        if self.dropout and self.training:  # dropout needs the weights: unfused path
            return self._attend_unfused(q, k, v, idx, allowed)
        N = B * h
        out = sparse_topk_attention(
            q.reshape(N, T, d), k.reshape(N, T, d), v.reshape(N, T, d),
            idx.view(N, T, -1), allowed.view(N, T, -1), scale(d),
        )  # fmt: skip
        return out.view(B, h, T, d)

    def _attend_short(
        self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor | None
    ) -> Tensor:
        """Short sequences: one fused SDPA call over all T x T pairs whose additive mask keeps
        the selected keys (0), drops the others (-inf) and penalises self (same result as the
        sparse path, cheaper up to `short_path_max_t`). valid (B, T) or None (no padding)."""
        T = q.shape[-2]
        bias = torch.full(q.shape[:-1] + (T,), float("-inf"), dtype=q.dtype, device=q.device)
        bias.scatter_(-1, idx, 0.0)  # (B, h, T, T)
        # Rows with fewer than k valid keys selected padded ones: drop them. On CPU a batch
        # whose mask pads nothing skips the pass (a free read); elsewhere it always runs.
        if valid is not None and (needs_static_shapes(valid) or not bool(valid.all())):
            bias.masked_fill_(~key_mask(valid)[:, None, None, :], float("-inf"))
        bias.diagonal(dim1=-2, dim2=-1).add_(SELF_PENALTY)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)

    def _attend_unfused(
        self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor
    ) -> Tensor:
        """SparseTopkAttention under plain autograd (gathers T kk d_k keys), with dropout."""
        B, h, T, d = q.shape
        kk = idx.shape[-1]
        flat = (idx + torch.arange(B * h, device=q.device).view(B, h, 1, 1) * T).reshape(-1)
        kg = k.reshape(B * h * T, d).index_select(0, flat).view(B, h, T, kk, d)
        vg = v.reshape(B * h * T, d).index_select(0, flat).view(B, h, T, kk, d)
        s = (q.unsqueeze(-2) @ kg.transpose(-1, -2)).squeeze(-2) * scale(d)  # (B, h, T, kk)
        s = s + (idx == torch.arange(T, device=q.device)[:, None]).to(s.dtype) * SELF_PENALTY
        probs = self.drop(masked_softmax(s, allowed))  # (B, h, T, kk)
        return (probs.unsqueeze(-2) @ vg).squeeze(-2)  # (B, h, T, d_k)

    def attend_dense(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        T = q.shape[-2]
        s = q @ k.transpose(-1, -2) * scale(self.head_dim)  # (B, h, T, T)
        s = s + torch.eye(T, device=x.device, dtype=s.dtype) * SELF_PENALTY
        allowed = self.selection_dense(q, k, valid) & key_mask(valid)[:, None, None, :]
        weights = masked_softmax(s, allowed)  # (B, h, T, T), at most k non-zeros per row
        return self.drop(weights) @ v, weights


@register("sign_alsh")
class SignALSHAttention(_LSHAttention):
    """Sign-ALSH (m = 2, U = 0.75)."""

    paper = "Shrivastava & Li, Improved Asymmetric LSH (ALSH) for MIPS, UAI 2015"
    transform = staticmethod(sign_alsh)
    extra_dims = 2


@register("xbox")
class XBOXAttention(_LSHAttention):
    """XBOX Euclidean transformation."""

    paper = "Bachrach et al., Speeding Up the Xbox Recommender System, RecSys 2014"
    transform = staticmethod(xbox)
    extra_dims = 1


@register("xbox_qnf")
class XBOXQNFAttention(_LSHAttention):
    """XBOX with query-normalised-first queries."""

    paper = "Huang et al., Accurate and Fast ALSH for MIPS (QNF), KDD 2018"
    transform = staticmethod(xbox_qnf)
    extra_dims = 1


@register("simple_lsh")
class SimpleLSHAttention(_LSHAttention):
    """Simple-LSH (symmetric after scaling keys into the unit ball)."""

    paper = (
        "Neyshabur & Srebro, On Symmetric and Asymmetric LSHs for Inner Product Search, ICML 2015"
    )
    transform = staticmethod(simple_lsh)
    extra_dims = 1


@register("simple_alsh")
class SimpleALSHAttention(_LSHAttention):
    """Simple-ALSH (asymmetric, queries and keys scaled into the unit ball)."""

    paper = (
        "Neyshabur & Srebro, On Symmetric and Asymmetric LSHs for Inner Product Search, ICML 2015"
    )
    transform = staticmethod(simple_alsh)
    extra_dims = 2

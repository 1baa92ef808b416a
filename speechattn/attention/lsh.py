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

Common scheme (the study, section 2.2): one shared projection gives q = k (shared-QK
projections; keys are *not* normalised since the MIPS transforms need their norms) and v.
Per sequence and head, M = max ||k_j|| over valid keys. Keys are transformed with P, queries
with Q, hashed by K sign random projections (one fixed seeded matrix per module, a registered
buffer, identical at train and inference). match_ij = number of equal bits. Each query keeps
its top-k keys by match; ties go to the nearer key, then the earlier one (deterministic). The
softmax runs over those k only, on the shared-QK scores q_i k_j / sqrt(d_k) with the self
penalty of `shared_qk` (-5e4). With fewer than k valid keys a query attends to all of them.

Under sign projections the bits are invariant to positive scaling, so xbox, xbox_qnf and
simple_lsh give identical codes, as do Sign-ALSH with and without QNF (tested; they would
differ only under an L2 / E2LSH hash, which is not implemented).

Cost: hashing O(T K D); matching O(T^2 K h) as one matmul of +-1 codes (with the tie-break
folded in) followed by top-k, chunked over queries so memory stays O(chunk T); attention on
the gathered keys O(T k D).
"""

from __future__ import annotations

import math
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
    key_mask,
    masked_softmax,
    scale,
)
from speechattn.attention.registry import register

Transform = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
_TINY = 1e-12
_MATCH_CHUNK = 1 << 21  # elements of one (B h, chunk, T) block of match scores
_GATHER_CHUNK = 1 << 21  # elements of one (B h, chunk, k, d_k) block of gathered keys


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


def tie_break(rows: Tensor, T: int) -> Tensor:
    """(R, T) values in (0, 1]: larger for nearer keys, then for the earlier of two equidistant."""
    j = torch.arange(T, device=rows.device)[None, :]
    rank = 2 * (rows[:, None] - j).abs() + (j > rows[:, None]).long()  # unique per row
    return 1 - rank.float() / (2 * T)


def _group_size(T: int, k: int) -> int:
    """Key group size S for the pruned top-k (minimises T / S + k S), 0 when not worth it."""
    S = 1 << max(2, round(math.log2(math.sqrt(T / k))))
    G = -(-T // S)
    return S if k < G and G + k * S < T // 2 else 0


def topk_by_match(cq: Tensor, ck: Tensor, kv: Tensor, k: int) -> Tensor:
    """Top-k keys per query by number of equal bits, ties to nearer then earlier keys.

    cq, ck (N, T, K) bool codes (N = B h), kv (N, T) allowed keys. Returns (N, T, min(k, T)).

    Composite score = (2 match - K) + tie-break in (0, 1], all values distinct in a row: one
    batched matmul of +-1 codes, where an extra code column subtracts 4 (K + 1) from
    disallowed keys (8 (K + 1) from the keys padding T to a multiple of S). Exact pruning for
    long rows: the top-k lie in the k groups of S consecutive keys with the largest group
    maxima (a group holding a top-k key has a maximum beaten by fewer than k keys), so each
    row needs a top-k over T / S group maxima and over k S candidates instead of over T.
    Rows are processed in chunks so the (N, chunk, T) scores stay small.
    """
    N, T, K = cq.shape
    kk = min(k, T)
    S = _group_size(T, kk)
    G = -(-T // S) if S else 1
    Tp = G * S if S else T
    dtype = torch.float32 if 9 * (K + 1) * 2 * Tp < (1 << 24) else torch.float64
    ones = torch.ones(N, T, 1, dtype=dtype, device=cq.device)
    sq = torch.cat([cq.to(dtype) * 2 - 1, ones], dim=-1)  # (N, T, K + 1)
    pen = (~kv[..., None]).to(dtype) * (-4.0 * (K + 1))  # (N, T, 1)
    sk = torch.cat([ck.to(dtype) * 2 - 1, pen], dim=-1)  # (N, T, K + 1)
    if Tp > T:
        fake = torch.zeros(N, Tp - T, K + 1, dtype=dtype, device=cq.device)
        fake[..., -1] = -8.0 * (K + 1)
        sk = torch.cat([sk, fake], dim=1)  # (N, Tp, K + 1)
    skT = sk.transpose(1, 2).contiguous()  # (N, K + 1, Tp)
    chunk = max(1, _MATCH_CHUNK // max(1, N * Tp))
    out = []
    for s in range(0, T, chunk):
        rows = torch.arange(s, min(s + chunk, T), device=cq.device)
        score = torch.bmm(sq[:, s : s + chunk], skT)  # (N, C, Tp)
        score += tie_break(rows, Tp).to(dtype)
        if not S:
            out.append(score.topk(kk, dim=-1, sorted=False).indices)
            continue
        C = rows.numel()
        blocks = score.view(N, C, G, S)
        groups = blocks.amax(-1).topk(kk, dim=-1, sorted=False).indices  # (N, C, kk)
        cand = blocks.gather(2, groups[..., None].expand(N, C, kk, S)).view(N, C, kk * S)
        pick = cand.topk(kk, dim=-1, sorted=False).indices  # (N, C, kk) in the candidates
        out.append(groups.gather(-1, pick // S) * S + pick % S)
    return torch.cat(out, dim=1)  # (N, T, kk)


class GatheredAttention(torch.autograd.Function):
    """Softmax attention of each query over its own selected keys, in query chunks.

    q, k, v (N, T, d_k), idx (N, T, kk) selected key positions, allowed (N, T, kk) bool,
    scale float. Scores q_i k_j * scale, with the self penalty where idx == i. Returns
    (N, T, d_k). Gathered keys/values exist only one chunk at a time (forward and backward),
    so memory is O(T kk) for the saved weights instead of O(T kk d_k).
    """

    @staticmethod
    def _chunks(N: int, T: int, kk: int, d: int) -> range:
        return range(0, T, max(1, _GATHER_CHUNK // max(1, N * kk * d)))

    @staticmethod
    def _gather(t: Tensor, flat: Tensor, shape: tuple[int, ...]) -> Tensor:
        return t.reshape(-1, t.shape[-1]).index_select(0, flat.reshape(-1)).view(shape)

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor, scale: float
    ) -> Tensor:
        N, T, d = q.shape
        kk = idx.shape[-1]
        flat = idx + torch.arange(N, device=q.device).view(N, 1, 1) * T  # rows of (N T, d)
        bias = (idx == torch.arange(T, device=q.device)[:, None]).to(q.dtype) * SELF_PENALTY
        out, probs = q.new_empty(q.shape), q.new_empty(idx.shape)
        step = GatheredAttention._chunks(N, T, kk, d).step
        for s in range(0, T, step):
            e = min(s + step, T)
            kg = GatheredAttention._gather(k, flat[:, s:e], (N, e - s, kk, d))
            sc = (q[:, s:e, None, :] @ kg.transpose(-1, -2)).squeeze(-2) * scale + bias[:, s:e]
            p = masked_softmax(sc, allowed[:, s:e])  # (N, C, kk)
            probs[:, s:e] = p
            vg = GatheredAttention._gather(v, flat[:, s:e], (N, e - s, kk, d))
            out[:, s:e] = (p[..., None, :] @ vg).squeeze(-2)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, flat, probs, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        q, k, v, flat, probs, out = ctx.saved_tensors
        N, T, d = q.shape
        kk = flat.shape[-1]
        g_q = torch.empty_like(q)
        g_k = torch.zeros(N * T, d, dtype=q.dtype, device=q.device)
        g_v = torch.zeros(N * T, d, dtype=q.dtype, device=q.device)
        step = GatheredAttention._chunks(N, T, kk, d).step
        for s in range(0, T, step):
            e = min(s + step, T)
            rows = flat[:, s:e].reshape(-1)
            kg = GatheredAttention._gather(k, flat[:, s:e], (N, e - s, kk, d))
            vg = GatheredAttention._gather(v, flat[:, s:e], (N, e - s, kk, d))
            go, p = grad[:, s:e], probs[:, s:e]  # (N, C, d), (N, C, kk)
            g_p = (go[..., None, :] @ vg.transpose(-1, -2)).squeeze(-2)  # (N, C, kk)
            delta = (go * out[:, s:e]).sum(-1, keepdim=True)
            g_s = p * (g_p - delta) * ctx.scale  # (N, C, kk)
            g_q[:, s:e] = (g_s[..., None, :] @ kg).squeeze(-2)
            g_k.index_add_(0, rows, (g_s[..., None] * q[:, s:e, None, :]).reshape(-1, d))
            g_v.index_add_(0, rows, (p[..., None] * go[:, :, None, :]).reshape(-1, d))
        return g_q, g_k.view(N, T, d), g_v.view(N, T, d), None, None, None


@dataclass
class LSHConfig(AttentionConfig):
    k: int = 32  # keys kept per query (top-k by matching bits)
    bits: int = 16  # K, sign random projections per code
    seed: int = 0  # seed of the fixed projection matrix

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.k < 1 or self.bits < 1:
            raise ValueError(f"need k >= 1 and bits >= 1, got k={self.k}, bits={self.bits}")


class _LSHAttention(Attention):
    """Shared-QK attention restricted to the top-k keys of an (A)LSH code match."""

    Config = LSHConfig
    transform: ClassVar[Transform]
    extra_dims: ClassVar[int]  # m, dimensions added by the transforms
    complexity_training = "O(T k D) attention + O(T K D) hashing + O(T^2 K h) code matching"
    complexity_inference = "O(T k D) attention + O(T K D) hashing + O(T^2 K h) code matching"

    def __init__(self, config: LSHConfig) -> None:
        super().__init__(config)
        self.k, self.bits = config.k, config.bits
        self.qv = nn.Linear(config.dim, 2 * config.dim, bias=config.bias)  # W^Q (= W^K) | W^V
        gen = torch.Generator().manual_seed(config.seed)
        proj = torch.randn(config.head_dim + self.extra_dims, config.bits, generator=gen)
        self.register_buffer("projection", proj)  # (d_k + m, K), fixed, saved with the model

    def keys_attended(self, T: int) -> float:
        return float(min(self.k, T))

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, v = self.qv(x).chunk(2, dim=-1)  # 2 x (B, T, D)
        q = self.split_heads(q)  # (B, h, T, d_k)
        return q, q, self.split_heads(v)

    @torch.no_grad()
    def codes(self, q: Tensor, k: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Query and key codes (B, h, T, K) bool; M over the valid keys of each sequence/head."""
        kv = key_mask(valid)[:, None, :, None]  # (B, 1, T, 1)
        M = (k.norm(dim=-1, keepdim=True) * kv).amax(dim=-2, keepdim=True).clamp_min(_TINY)
        Qq, Pk = type(self).transform(q, k, M)  # (B, h, T, d_k + m)
        return sign_codes(Qq, self.projection), sign_codes(Pk, self.projection)

    @torch.no_grad()
    def select(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Top-k key indices (B, h, T, min(k, T)) (fast path; no gradient)."""
        B, h, T, _ = q.shape
        cq, ck = self.codes(q, k, valid)
        kv = key_mask(valid)[:, None].expand(B, h, T).reshape(B * h, T)
        idx = topk_by_match(cq.reshape(B * h, T, -1), ck.reshape(B * h, T, -1), kv, self.k)
        return idx.view(B, h, T, -1)

    @torch.no_grad()
    def selection_dense(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Reference selection (B, h, T, T) bool from explicit match counts and a sort."""
        B, h, T, _ = q.shape
        cq, ck = self.codes(q, k, valid)
        match = (cq[:, :, :, None, :] == ck[:, :, None, :, :]).sum(-1)  # (B, h, T, T)
        i = torch.arange(T, device=q.device)
        rank = 2 * (i[:, None] - i[None, :]).abs() + (i[None, :] > i[:, None]).long()  # (T, T)
        key = (
            match * (4 * T)
            - rank
            - (~key_mask(valid))[:, None, None, :] * (4 * T * (self.bits + 2))
        )
        order = key.argsort(dim=-1, descending=True)[..., : min(self.k, T)]
        return torch.zeros_like(match, dtype=torch.bool).scatter(-1, order, True)

    def attend(self, x: Tensor, valid: Tensor) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        B, h, T, d = q.shape
        idx = self.select(q, k, valid)  # (B, h, T, kk)
        allowed = key_mask(valid).gather(1, idx.reshape(B, -1)).view(idx.shape)
        if self.dropout and self.training:  # dropout needs the weights: unfused path
            return self._attend_unfused(q, k, v, idx, allowed)
        N = B * h
        out = GatheredAttention.apply(
            q.reshape(N, T, d), k.reshape(N, T, d), v.reshape(N, T, d),
            idx.view(N, T, -1), allowed.view(N, T, -1), scale(d),
        )  # fmt: skip
        return out.view(B, h, T, d)

    def _attend_unfused(
        self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, allowed: Tensor
    ) -> Tensor:
        """GatheredAttention under plain autograd (keeps the gathered keys), with dropout."""
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

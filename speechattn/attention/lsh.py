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

`shared_qk`'s scores (so LSH with k >= T is `shared_qk` exactly), restricted per query to its
top-k other keys by the number of equal hashes of Q(q_i) and P(k_j) under one fixed seeded
projection per module; ties to the larger score (float64 sums rounded to float32, so every
kernel computes it alike: `kernels/topk.py: tie_scores`), then the nearer, then the earlier key.
Definition, options, the first runs' variants and `same_model`: docs/attention.md, "LSH".

Cost: hashing O(T K D); matching O(T^2 K h) bit operations or comparisons, then a threshold on
the match counts found by counting, not sorting (only the keys tied at it are scored: O(T c D),
c about k); on the CPU one compiled kernel per layer (`kernels/topk_cpu.py`), on GPUs the tensor
version (`kernels/topk.py`). Attention on the selected keys: up to `short_path_max_t` frames one
all-pairs SDPA call masked to them, above O(T k D) gathered products (`kernels/sparse_topk*.py`;
a custom op, so torch.compile keeps it in its graph).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from speechattn.attention.autotune import use_short_path
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
    require,
    scale,
    unit_keys,
    widen,
)
from speechattn.attention.dot_product import SharedQKBase
from speechattn.attention.fp32 import ieee_matmul
from speechattn.attention.kernels.sparse_topk import sparse_topk_attention
from speechattn.attention.kernels.topk import ordered_bits, tie_scores, topk_by_match
from speechattn.attention.registry import register

Transform = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
_TINY = 1e-12


# ------------------------------------------------------------------ transforms Q(q), P(k)
# q, k (..., T, d_k); M (..., 1, 1) max valid key norm. Return (Q(q), P(k)), (..., T, d_k + m).
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
    return F.pad(unit_keys(q) * M if qnf else unit_keys(q), (0, 2)), P


def xbox(q: Tensor, k: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """P(x) = [x; sqrt(M^2 - ||x||^2)]; Q(q) = [q; 0]."""
    P = torch.cat([k, (M.pow(2) - _sq_norm(k)).clamp_min(0).sqrt()], dim=-1)
    return F.pad(q, (0, 1)), P


def xbox_qnf(q: Tensor, k: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """XBOX keys; Q(q) = [M q/||q||; 0] (query normalised first)."""
    _, P = xbox(q, k, M)
    return F.pad(unit_keys(q) * M, (0, 1)), P


def simple_lsh(q: Tensor, k: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """x = k / M; P(x) = [x; sqrt(1 - ||x||^2)]; Q(q) = [q/||q||; 0]."""
    x = k / M
    P = torch.cat([x, (1 - _sq_norm(x)).clamp_min(0).sqrt()], dim=-1)
    return F.pad(unit_keys(q), (0, 1)), P


def simple_alsh(q: Tensor, k: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """x = k / M, y = q / M (unit ball); P(x) = [x; sqrt(1-||x||^2); 0]; Q(y) = [y; 0; sqrt(1-||y||^2)]."""
    x, y = k / M, q / M
    P = torch.cat([x, (1 - _sq_norm(x)).clamp_min(0).sqrt(), torch.zeros_like(x[..., :1])], dim=-1)
    Qq = torch.cat([y, torch.zeros_like(y[..., :1]), (1 - _sq_norm(y)).clamp_min(0).sqrt()], dim=-1)
    return Qq, P


def sign_codes(z: Tensor, projection: Tensor) -> Tensor:
    """Sign random projection bits: z (..., T, d) @ projection (d, K) > 0 -> (..., T, K) bool,
    in true float32 for float32 z."""
    return ieee_matmul(z, projection.to(z.dtype)) > 0


def l2_codes(z: Tensor, projection: Tensor, offsets: Tensor, scale: Tensor) -> Tensor:
    """E2LSH buckets floor(z @ projection / scale + offsets): z (..., T, d), projection (d, K),
    offsets (K,) in [0, 1), scale (..., 1, 1) = M w -> (..., T, K) int32."""
    u = ieee_matmul(z, projection.to(z.dtype)) / scale + offsets.to(z.dtype)
    return u.floor().to(torch.int32)


@dataclass
class LSHConfig(AttentionConfig):
    k: int = 32  # keys kept per query (top-k by matching hashes)
    bits: int = 16  # K, hash functions per code (sign: one bit each; l2: one bucket each)
    seed: int = 0  # with the layer index, seeds the fixed projection matrix
    # Options below: docs/attention.md, "LSH" (the non-defaults give the first runs' variants).
    normalize_keys: bool = True  # score with shared_qk's keys q / ||q||; False: raw q_i . q_j
    tie_break: str = "score"  # equal match counts: larger score first, or "position" (nearer)
    hash: str = "sign"  # SimHash bits, or "l2": E2LSH buckets (`L2HashConfig`)
    bucket_width: float = 2.5  # w of the l2 hash, in units of M (the ALSH paper's r = 2.5)
    hash_keys: str = "scored"  # the key side hashes the scored keys, or "shared": raw q

    def __post_init__(self) -> None:
        super().__post_init__()
        k, bits = self.k, self.bits
        require(k >= 1 and bits >= 1, f"need k >= 1 and bits >= 1, got k={k}, bits={bits}")
        for option, allowed in (
            ("tie_break", ("score", "position")),
            ("hash", ("sign", "l2")),
            ("hash_keys", ("scored", "shared")),
        ):
            value = getattr(self, option)
            require(
                value in allowed,
                f"LSH {option} must be one of {', '.join(map(repr, allowed))}, got {value!r}",
            )
        width = self.bucket_width
        require(width > 0, f"LSH bucket_width must be > 0, got {width}")


@dataclass
class L2HashConfig(LSHConfig):
    """The schemes whose papers reduce MIPS to Euclidean near neighbours: E2LSH by default."""

    hash: str = "l2"


class _LSHAttention(SharedQKBase):
    """Shared-QK attention restricted to the top-k keys of an (A)LSH code match (the hashes'
    projection matrix is one for every head: pruning keeps it)."""

    Config = LSHConfig
    transform: ClassVar[Transform]
    extra_dims: ClassVar[int]  # m, dimensions added by the transforms
    unit_ball: ClassVar[bool] = True  # transforms map into the unit ball; False: l2 hash / M
    complexity_training = (
        "O(T k D) attention + O(T K D) hashing + O(T^2 K h) code matching + O(T k D) tie-break"
    )
    complexity_inference = complexity_training
    short_path_max_t = 256  # all-pairs SDPA masked to the selection up to here, CSR above

    def __init__(self, config: LSHConfig) -> None:
        super().__init__(config)
        c = config
        self.k, self.bits, self.hash, self.hash_keys = c.k, c.bits, c.hash, c.hash_keys
        self.normalize_keys, self.tie_break = c.normalize_keys, c.tie_break
        self.bucket_width = c.bucket_width
        gen = torch.Generator().manual_seed(layer_seed(config.seed, config.layer))
        proj = torch.randn(config.head_dim + self.extra_dims, config.bits, generator=gen)
        self.register_buffer("projection", proj)  # (d_k + m, K), fixed, saved with the model
        if self.hash == "l2":  # the buckets' offsets b / w in [0, 1), drawn after the matrix
            self.register_buffer("offsets", torch.rand(config.bits, generator=gen))

    def keys_attended(self, T: int) -> float:
        return float(min(self.k, T))

    def flops(self, T: int) -> Flops:
        h, K, keys = self.num_heads, self.bits, min(self.k, T)
        hashing = 2 * linear_flops(T, self.head_dim + self.extra_dims, K) * h  # Q(q), P(k)
        matching = 2.0 * T * T * (K + 1) * h  # +-1 codes and a validity column, as defined
        if self.tie_break == "score":  # scores of the contested keys, about k per query
            matching += 2.0 * T * keys * self.inner_dim
        return Flops(self.dot_product_flops(T, keys).differentiable, hashing + matching)

    @torch.no_grad()
    def codes(self, q: Tensor, k: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
        """Query and key codes (B, h, T, K): bool (sign) or int32 buckets (l2); k the vectors the
        key side hashes, M over the valid keys (valid (B, T) or None). In float32, autocast off:
        half-precision transforms would flip bits of the fp32 model."""
        with torch.autocast(q.device.type, enabled=False):
            q, k = widen(q), widen(k)
            norms = k.norm(dim=-1, keepdim=True)  # (B, h, T, 1)
            if valid is not None:
                norms = norms * key_mask(valid)[:, None, :, None]
            M = norms.amax(dim=-2, keepdim=True).clamp_min(_TINY)  # (B, h, 1, 1)
            z = torch.stack(type(self).transform(q, k, M))  # (2, B, h, T, d_k + m): Q(q), P(k)
            if self.hash == "sign":
                codes = sign_codes(z, self.projection)
            else:
                scale = (1.0 if self.unit_ball else M) * self.bucket_width
                codes = l2_codes(z, self.projection, self.offsets, scale)
            return codes[0], codes[1]

    def hashed_keys(self, q: Tensor, k: Tensor) -> Tensor:
        return k if self.hash_keys == "scored" else q

    @torch.no_grad()
    def match_counts(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Equal hashes of every query-key pair (B, h, T, T), written out (references)."""
        cq, ck = self.codes(q, self.hashed_keys(q, k), valid)
        return (cq[:, :, :, None, :] == ck[:, :, None, :, :]).sum(-1)

    @torch.no_grad()
    def select(self, q: Tensor, k: Tensor, valid: Tensor | None) -> Tensor:
        """Top-k key indices (B, h, T, min(k, T)) for q, k (B, h, T, d_k), valid (B, T) or None."""
        B, h, T, d = q.shape
        cq, ck = self.codes(q, self.hashed_keys(q, k), valid)
        if valid is None:
            kv = torch.ones(B * h, T, dtype=torch.bool, device=q.device)
        else:
            kv = key_mask(valid)[:, None].expand(B, h, T).reshape(B * h, T)
        scores = (
            (q.reshape(B * h, T, d), k.reshape(B * h, T, d)) if self.tie_break == "score" else ()
        )
        with torch.autocast(q.device.type, enabled=False):  # exact integer match counts
            idx = topk_by_match(
                cq.reshape(B * h, T, -1), ck.reshape(B * h, T, -1), kv, self.k, *scores
            )
        return idx.view(B, h, T, -1)

    @torch.no_grad()
    def selection_dense(self, q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
        """Reference selection (B, h, T, T) bool from explicit match counts and a sort."""
        B, h, T, _ = q.shape
        match = self.match_counts(q, k, valid)  # (B, h, T, T)
        i = torch.arange(T, device=q.device)
        rank = 2 * (i[:, None] - i[None, :]).abs() + (i[None, :] > i[:, None]).long()  # (T, T)
        # The match count first: self sits below the other valid keys, every disallowed key
        # below self; then the score (its float32 order, `ordered_bits`), then the position.
        own = torch.eye(T, dtype=torch.long, device=q.device) * (self.bits + 1)
        disallowed = (~key_mask(valid))[:, None, None, :] * (2 * self.bits + 4)
        tie, above = 2 * T - rank, 2 * T + 1  # (T, T) in [1, 2T], and a bound above it
        if self.tie_break == "score":  # (B, h, T, T), the order of the float32 scores
            tie, above = ordered_bits(tie_scores(q, k)) * above + tie, above << 32
        key = (match - own - disallowed) * above + tie
        order = key.argsort(dim=-1, descending=True)[..., : min(self.k, T)]
        return torch.zeros_like(match, dtype=torch.bool).scatter(-1, order, True)

    def attend(self, x: Tensor, valid: Tensor | None) -> Tensor:
        q, k, v = self._qkv(x)  # (B, h, T, d_k)
        B, h, T, d = q.shape
        idx = self.select(q, k, valid)  # (B, h, T, kk)
        if use_short_path(self, q):
            return self._attend_short(q, k, v, idx, valid)
        valid = all_valid(x) if valid is None else valid
        allowed = key_mask(valid).gather(1, idx.reshape(B, -1)).view(idx.shape)
        if self.dropout and self.training:  # dropout needs the weights: unfused path
            return self._attend_unfused(q, k, v, idx, allowed)
        N = B * h
        out = sparse_topk_attention(
            q.reshape(N, T, d),
            k.reshape(N, T, d),
            v.reshape(N, T, d),
            idx.view(N, T, -1),
            allowed.view(N, T, -1),
            scale(d),
        )
        return out.view(B, h, T, d)

    def _attend_short(
        self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor | None
    ) -> Tensor:
        """One SDPA call over all T x T pairs masked to the selection, self penalised."""
        T = q.shape[-2]
        bias = torch.full(q.shape[:-1] + (T,), float("-inf"), dtype=q.dtype, device=q.device)
        bias.scatter_(-1, idx, 0.0)  # (B, h, T, T)
        # Rows with fewer than k valid keys selected padded ones: drop them. On CPU a batch
        # whose mask pads nothing skips the pass (a free read); elsewhere it always runs.
        if valid is not None and (needs_static_shapes(valid) or not bool(valid.all())):
            bias.masked_fill_(~key_mask(valid)[:, None, None, :], float("-inf"))
        bias.diagonal(dim1=-2, dim2=-1).add_(SELF_PENALTY)
        return self.sdpa(q, k, v, bias)

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
        allowed = self.selection_dense(q, k, valid) & key_mask(valid)[:, None, None, :]
        return self.weigh(self.shared_scores(q, k), allowed, v)  # at most k non-zeros per row


def same_model(a: Attention, b: Attention, T: int = 256, seed: int = 0) -> bool:
    """Whether two LSH modules are one model: the same options and the same match counts on
    T random shared vectors of spread norms (everything depends on the codes only through them)."""
    if not (isinstance(a, _LSHAttention) and isinstance(b, _LSHAttention)):
        return a is b
    if vars(a.config) != vars(b.config):
        return False
    g = torch.Generator().manual_seed(seed)
    shape = (1, a.num_heads, T, a.head_dim)
    q = torch.randn(shape, generator=g) * torch.randn(shape[:-1] + (1,), generator=g).exp()
    valid = torch.ones(1, T, dtype=torch.bool)
    k = unit_keys(q) if a.normalize_keys else q
    return torch.equal(a.match_counts(q, k, valid), b.match_counts(q, k, valid))


NEYSHABUR = (
    "Neyshabur & Srebro, On Symmetric and Asymmetric LSHs for Inner Product Search, ICML 2015"
)


@register("sign_alsh")
class SignALSHAttention(_LSHAttention):
    """Sign-ALSH (m = 2, U = 0.75)."""

    paper = "Shrivastava & Li, Improved Asymmetric LSH (ALSH) for MIPS, UAI 2015"
    transform, extra_dims = staticmethod(sign_alsh), 2


@register("xbox")
class XBOXAttention(_LSHAttention):
    """XBOX Euclidean transformation."""

    paper = "Bachrach et al., Speeding Up the Xbox Recommender System, RecSys 2014"
    Config, transform, unit_ball, extra_dims = L2HashConfig, staticmethod(xbox), False, 1


@register("xbox_qnf")
class XBOXQNFAttention(_LSHAttention):
    """XBOX with query-normalised-first queries."""

    paper = "Huang et al., Accurate and Fast ALSH for MIPS (QNF), KDD 2018"
    Config, transform, unit_ball, extra_dims = L2HashConfig, staticmethod(xbox_qnf), False, 1


@register("simple_lsh")
class SimpleLSHAttention(_LSHAttention):
    """Simple-LSH (symmetric after scaling keys into the unit ball)."""

    paper, transform, extra_dims = NEYSHABUR, staticmethod(simple_lsh), 1


@register("simple_alsh")
class SimpleALSHAttention(_LSHAttention):
    """Simple-ALSH (asymmetric, queries and keys scaled into the unit ball)."""

    paper, transform, extra_dims = NEYSHABUR, staticmethod(simple_alsh), 2


SCHEMES = ("sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh")

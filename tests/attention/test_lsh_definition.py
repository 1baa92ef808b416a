"""LSH's definition: against a brute-force float64 reference written from the papers (both
hashes, both sets of hashed keys), against shared_qk (the same normalised keys: LSH with
k >= T is `shared_qk` exactly), and match-count ties broken by the true score, not by
position."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import DIM, HEADS, batch, force_path, make

from speechattn.attention import lsh
from speechattn.attention.base import unit_keys
from speechattn.attention.kernels import topk

LSH = ["sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh"]


def _as_shared_qk(attn: torch.nn.Module) -> torch.nn.Module:
    """A `shared_qk` module with `attn`'s projections (both are W^Q | W^V and W^O)."""
    ref = make("shared_qk")
    fixed = ("projection", "offsets")  # the hash's buffers
    ref.load_state_dict({k: v for k, v in attn.state_dict().items() if k not in fixed})
    return ref


def _transformed(name: str, q, keys, M):
    """(Q(q), P(k)) of each paper, written out again in float64 (`lsh.py` has its own)."""
    pad = torch.zeros_like(q[..., :1])
    unit_q = q / q.norm(dim=-1, keepdim=True)
    if name == "sign_alsh":  # m = 2, U = 0.75
        x = keys * 0.75 / M
        n2 = (x * x).sum(-1, keepdim=True)
        return torch.cat([unit_q, pad, pad], -1), torch.cat([x, 0.5 - n2, 0.5 - n2**2], -1)
    if name in ("xbox", "xbox_qnf"):
        P = torch.cat([keys, (M**2 - (keys * keys).sum(-1, keepdim=True)).clamp_min(0).sqrt()], -1)
        return torch.cat([q if name == "xbox" else M * unit_q, pad], -1), P
    x = keys / M
    tail = (1 - (x * x).sum(-1, keepdim=True)).clamp_min(0).sqrt()
    if name == "simple_lsh":
        return torch.cat([unit_q, pad], -1), torch.cat([x, tail], -1)
    y = q / M  # simple_alsh
    y_tail = (1 - (y * y).sum(-1, keepdim=True)).clamp_min(0).sqrt()
    return torch.cat([y, pad, y_tail], -1), torch.cat([x, tail, pad], -1)


def reference_selection(attn, x, valid) -> torch.Tensor:
    """Brute force in float64: hash, count equal hashes, and sort every query's keys by (match
    count, float32 score, nearer, earlier), own key below the other valid keys, padded keys
    (by their match too) below it. Returns (B, h, T, T) bool, the top min(k, T) of each row."""
    B, T, D = x.shape
    h, d = attn.num_heads, D // attn.num_heads
    q = (x @ attn.qv.weight.T + attn.qv.bias)[..., :D].view(B, T, h, d).transpose(1, 2)
    keys = q / q.norm(dim=-1, keepdim=True) if attn.normalize_keys else q
    hashed = keys if attn.hash_keys == "scored" else q
    kv = valid[:, None, :, None]  # (B, 1, T, 1)
    M = (hashed.norm(dim=-1, keepdim=True) * kv).amax(dim=-2, keepdim=True)
    Q, P = _transformed(attn.name, q, hashed, M)
    A = attn.projection.double()
    if attn.hash == "sign":
        cq, ck = Q @ A > 0, P @ A > 0
    else:
        width = attn.bucket_width * (M if attn.name in ("xbox", "xbox_qnf") else 1.0)
        cq, ck = ((Z @ A / width + attn.offsets.double()).floor() for Z in (Q, P))
    match = (cq[:, :, :, None, :] == ck[:, :, None, :, :]).sum(-1)  # (B, h, T, T)
    score = (q @ keys.transpose(-1, -2)).float().double()  # compared in float32
    own, bits = torch.eye(T, dtype=torch.bool), attn.bits
    allowed = valid[:, None, None, :]  # padded keys rank below own, also by their match
    level = torch.where(
        allowed, torch.where(own, bits + 1.5, bits + 2 + match), torch.where(own, 0, 1 + match)
    )
    i = torch.arange(T)
    near = -(2 * (i[None, :] - i[:, None]).abs() + (i[None, :] > i[:, None])).double()
    if attn.tie_break == "position":
        score = torch.zeros_like(score)
    # lexicographic: level, then score, then nearness (stable sorts, least significant first)
    order = near.expand(B, h, T, T).argsort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, score.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
    order = order.gather(-1, level.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
    top = order[..., : min(attn.k, T)]
    return torch.zeros(B, h, T, T, dtype=torch.bool).scatter(-1, top, True)


@pytest.mark.parametrize("hash_keys", ["scored", "shared"])
@pytest.mark.parametrize("normalize_keys", [True, False])
@pytest.mark.parametrize("hash", ["sign", "l2"])
@pytest.mark.parametrize("name", LSH)
def test_selection_equals_the_brute_force_reference(name, hash, normalize_keys, hash_keys):
    """Every scheme, both hashes, both sets of hashed keys; padded; 5 bits and k = 6 make
    match ties frequent, so the score and position tie-breaks are exercised."""
    attn = make(name, k=6, bits=5, hash=hash, normalize_keys=normalize_keys, hash_keys=hash_keys)
    x, pad = batch([40, 23, 4, 1])
    q, k, _ = attn._qkv(x)
    got = torch.zeros(4, HEADS, 40, 40, dtype=torch.bool).scatter(-1, attn.select(q, k, ~pad), True)
    assert torch.equal(got, reference_selection(attn, x, ~pad))


def test_each_scheme_defaults_to_its_papers_hash():
    """XBOX and its QNF form reduce MIPS to Euclidean search (l2); the others use signs."""
    hashes = {name: make(name).hash for name in LSH}
    assert hashes == {
        "sign_alsh": "sign", "xbox": "l2", "xbox_qnf": "l2", "simple_lsh": "sign",
        "simple_alsh": "sign",
    }  # fmt: skip


@pytest.mark.parametrize("name", LSH)
@pytest.mark.parametrize("limit", [10**6, 0])  # short path, sparse path
def test_lsh_with_k_at_least_T_is_shared_qk(name, limit, monkeypatch):
    monkeypatch.setattr(type(make(name)), "short_path_max_t", limit)
    attn = make(name, k=1000)
    x, pad = batch([20, 12, 1])
    torch.testing.assert_close(attn(x, pad), _as_shared_qk(attn)(x, pad), rtol=0, atol=1e-12)


def test_lsh_raw_keys_remain_an_option():
    """normalize_keys=False scores q_i . q_j (the first runs): then it is not shared_qk."""
    attn = make("xbox", k=1000, normalize_keys=False)
    x, pad = batch([20, 12])
    assert (attn(x, pad) - _as_shared_qk(attn)(x, pad)).abs().max() > 1e-3


def _tied_codes(N: int, T: int, K: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query matches every key in all K bits: the top-k is decided by the tie-break."""
    codes = torch.ones(N, T, K, dtype=torch.bool)
    return codes, codes.clone()


@pytest.mark.parametrize("T", [40, 300])  # plain top-k; grouped (pruned) top-k
def test_match_ties_go_to_the_larger_score(T):
    g = torch.Generator().manual_seed(0)
    q, keys = (torch.randn(2, T, 6, generator=g, dtype=torch.float64) for _ in range(2))
    cq, ck = _tied_codes(2, T)
    kv = torch.ones(2, T, dtype=torch.bool)
    idx = topk.topk_by_match(cq, ck, kv, 7, q, keys)
    s = q @ keys.transpose(-1, -2)
    s.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))  # self ranks below every other key
    want = s.topk(7, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, want.sort(-1).values)


def test_exact_score_ties_go_to_the_nearer_then_earlier_key():
    T = 40
    cq, ck = _tied_codes(1, T)
    q = torch.ones(1, T, 3)
    keys = torch.ones(1, T, 3)  # all scores equal
    idx = topk.topk_by_match(cq, ck, torch.ones(1, T, dtype=torch.bool), 4, q, keys)
    assert sorted(idx[0, 20].tolist()) == [18, 19, 21, 22]
    assert sorted(idx[0, 0].tolist()) == [1, 2, 3, 4]


def test_position_tie_break_remains_an_option():
    T = 40
    cq, ck = _tied_codes(1, T)
    kv = torch.ones(1, T, dtype=torch.bool)
    assert sorted(topk.topk_by_match(cq, ck, kv, 4)[0, 20].tolist()) == [18, 19, 21, 22]
    attn = make("xbox", tie_break="position")
    x, pad = batch([30, 17])
    q, k, _ = attn._qkv(x)
    fast = torch.zeros(2, HEADS, 30, 30, dtype=torch.bool).scatter(
        -1, attn.select(q, k, ~pad), True
    )
    assert torch.equal(fast[0], attn.selection_dense(q, k, ~pad)[0])


def selected_distance(tie_break: str, T: int = 300, k: int = 32, bits: int = 16) -> float:
    """Mean |i - j| of the keys each query selects, random inputs (the issue's measure)."""
    torch.manual_seed(0)
    attn = lsh.XBOXAttention(lsh.LSHConfig(DIM, HEADS, k=k, bits=bits, tie_break=tie_break))
    x = torch.randn(2, T, DIM)
    q, kk, _ = attn._qkv(x)
    idx = attn.select(q, kk, torch.ones(2, T, dtype=torch.bool))  # (B, h, T, k)
    return float((idx - torch.arange(T)[:, None]).abs().float().mean())


def test_score_tie_break_adds_no_locality():
    """Random keys at T = 300 are on average ~100 frames away; the position tie-break
    pulled the selected ones nearer (~82), the score tie-break does not."""
    assert selected_distance("position") < 90 < selected_distance("score")


def test_unit_keys_are_f_normalize_with_its_gradient():
    """The shared-QK keys (shared_qk, sparse, LSH) have their own short backward: the same
    keys bit for bit and the same gradient as F.normalize's, rows of zero and of clamped
    norm included."""
    q = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    q[0, 0, 0], q[0, 1, 2] = 0.0, 1e-14  # a zero row, a row under the 1e-12 clamp
    q.requires_grad_()
    g = torch.randn_like(q)
    want = torch.nn.functional.normalize(q, dim=-1)
    got = unit_keys(q)
    assert torch.equal(got, want)
    (want_grad,) = torch.autograd.grad(want, q, g)
    (got_grad,) = torch.autograd.grad(got, q, g)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", ["short", "long"])
@pytest.mark.parametrize("hash", ["sign", "l2"])
@pytest.mark.parametrize("name", LSH)
def test_no_padding_selects_as_an_all_valid_mask(name, hash, path, monkeypatch):
    """valid=None (nothing padded) skips the mask's operations, not its meaning."""
    force_path(monkeypatch, path)
    attn = make(name, k=6, bits=5, hash=hash)
    x, _ = batch([40, 40])
    q, k, _ = attn._qkv(x)
    everything = torch.ones(2, 40, dtype=torch.bool)
    assert torch.equal(attn.select(q, k, None), attn.select(q, k, everything))
    torch.testing.assert_close(attn(x), attn(x, ~everything), rtol=0, atol=0)

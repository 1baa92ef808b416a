"""LSH's definition against shared_qk: the same normalised keys (LSH with k >= T is
`shared_qk` exactly) and match-count ties broken by the true score, not by position."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import DIM, HEADS, batch, make

from speechattn.attention import lsh
from speechattn.attention.kernels import topk

LSH = ["sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh"]


def _as_shared_qk(attn: torch.nn.Module) -> torch.nn.Module:
    """A `shared_qk` module with `attn`'s projections (both are W^Q | W^V and W^O)."""
    ref = make("shared_qk")
    ref.load_state_dict({k: v for k, v in attn.state_dict().items() if k != "projection"})
    return ref


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

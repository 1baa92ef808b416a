"""LSH's fast selection (`topk_by_match`: a threshold on the match counts, scores for the tied
keys only) against the all-pairs definition, key set for key set: every variant, both
tie-breaks, float64 and float32, padded batches, k above the valid length, many ties, several
chunks, and both kernels (the compiled CPU kernel; the tensor version with static shapes, as
GPUs run it)."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import HEADS, batch, make

from speechattn.attention.kernels import topk

LSH = ["sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh"]


@pytest.fixture(params=["cpu", "static"])
def path(request, monkeypatch) -> str:
    """The compiled CPU kernel, or the tensor version with static shapes (the GPU code)."""
    if request.param == "static":
        monkeypatch.setattr(topk, "_use_cpu_kernel", lambda t: False)
    return request.param


def as_sets(idx: torch.Tensor, T: int) -> torch.Tensor:
    """Selected indices (..., kk) -> (..., T) bool."""
    return torch.zeros(idx.shape[:-1] + (T,), dtype=torch.bool).scatter(-1, idx, True)


def definition(cq, ck, kv, k, q=None, keys=None) -> torch.Tensor:
    """The definition, written out as a lexicographic sort (stable sorts, least significant
    key first): match count (own key below the other allowed keys, disallowed keys below
    it), then the float32 score (`tie_scores`), then nearer, then earlier. (N, T, T) bool."""
    N, T, K = cq.shape
    match = (cq[:, :, None, :] == ck[:, None, :, :]).sum(-1)  # (N, T, T)
    i = torch.arange(T)
    own = i[:, None] == i[None, :]
    group = torch.where(kv[:, None, :], torch.where(own, 2, 3), torch.where(own, 0, 1))
    rank = (2 * (i[None, :] - i[:, None]).abs() + (i[None, :] > i[:, None])).expand(N, T, T)
    order = rank.argsort(dim=-1, stable=True)  # nearer first, then earlier
    if q is not None:
        s = topk.tie_scores(q, keys).gather(-1, order)
        order = order.gather(-1, (-s).argsort(dim=-1, stable=True))
    level = (group * (K + 1) + torch.where(group % 2 == 1, match, 0)).gather(-1, order)
    order = order.gather(-1, (-level).argsort(dim=-1, stable=True))
    return as_sets(order[..., : min(k, T)], T)


def random_case(N, T, K, d, seed, dtype=torch.float64, valid_frac=0.8):
    g = torch.Generator().manual_seed(seed)
    cq, ck = (torch.rand(N, T, K, generator=g) > 0.5 for _ in range(2))
    kv = torch.rand(N, T, generator=g) < valid_frac
    q, keys = (torch.randn(N, T, d, generator=g, dtype=dtype) for _ in range(2))
    return cq, ck, kv, q, keys


@pytest.mark.parametrize("by_score", [True, False], ids=["score", "position"])
@pytest.mark.parametrize(
    ("T", "K", "k"),
    [(40, 3, 7), (300, 6, 32), (257, 16, 9), (64, 8, 64), (50, 8, 80), (130, 62, 5)],
)
def test_kernel_equals_the_definition(T, K, k, by_score, path):
    """Few bits: most keys tie in the match count; k >= T, k > T; 62 bits: int16 levels."""
    cq, ck, kv, q, keys = random_case(3, T, K, 5, seed=T + K)
    kv[1, 3:] = False  # fewer allowed keys than k
    kv[2] = False  # none
    args = (q, keys) if by_score else ()
    got = topk.topk_by_match(cq, ck, kv, k, *args)
    assert torch.equal(as_sets(got, T), definition(cq, ck, kv, k, *args))
    assert torch.equal(got, got.sort(dim=-1).values)  # increasing key order


@pytest.mark.parametrize("by_score", [True, False], ids=["score", "position"])
@pytest.mark.parametrize(
    ("T", "K", "buckets"),
    [(60, 3, 3), (300, 12, 5), (257, 16, 2), (300, 5, 10_000)],
    ids=["3-hashes", "12-hashes", "16-hashes", "many-buckets"],
)
def test_l2_bucket_codes_equal_the_definition(T, K, buckets, by_score, path):
    """Integer (l2) codes: a match is an equal bucket, few or many buckets per hash."""
    g = torch.Generator().manual_seed(T + K)
    cq, ck = (
        torch.randint(-buckets // 2, buckets - buckets // 2, (3, T, K), generator=g)
        for _ in range(2)
    )
    cq[0, :5] = 10**6  # query buckets that no key has
    kv = torch.rand(3, T, generator=g) < 0.8
    kv[1, 3:] = False
    q, keys = (torch.randn(3, T, 5, generator=g, dtype=torch.float64) for _ in range(2))
    args = (q, keys) if by_score else ()
    got = topk.topk_by_match(cq, ck, kv, 9, *args)
    assert torch.equal(as_sets(got, T), definition(cq, ck, kv, 9, *args))


@pytest.mark.parametrize("k", [32, 100, 700])
def test_long_rows_where_the_threshold_lies_far_below_the_best(k):
    """The CPU kernel at T = 2048, 16 bits: with k = 32 the threshold lies within 3 levels of
    a row's best (one counting pass), with k = 100 and 700 below that (more passes)."""
    cq, ck, kv, q, keys = random_case(1, 2048, 16, 4, seed=k, dtype=torch.float32, valid_frac=1)
    got = topk.topk_by_match(cq, ck, kv, k, q, keys)
    assert torch.equal(as_sets(got, 2048), definition(cq, ck, kv, k, q, keys))


@pytest.mark.slow  # compiles the threaded build for each code format (about 30 s)
@pytest.mark.parametrize(
    ("codes", "K", "T", "span"),
    [("sign", 16, 200, 0), ("sign", 100, 131, 0), ("l2", 5, 131, 2), ("l2", 20, 200, 4),
     ("l2", 7, 131, 40)],
    ids=["one-word", "seven-words", "2-planes", "3-planes-two-groups", "6-planes"],
)  # fmt: skip
def test_cpu_kernel_threaded_and_serial_and_each_code_format(codes, K, T, span):
    """The CPU kernel's two builds (threaded, and serial for one thread) and each way it
    stores codes, 16 hashes per 16-bit word: sign bits in one word or several (each group
    of hashes adding to the levels of the ones before); l2 buckets as bit planes, as many
    as the buckets' span needs (2 and 3 in one vector pass, 6 ORed in passes); T not a
    multiple of the 64-key masks."""
    cq, ck, kv, q, keys = random_case(2, T, K, 8, seed=K, dtype=torch.float32)
    if codes == "l2":
        g = torch.Generator().manual_seed(T)
        cq, ck = (torch.randint(-1, span - 1, (2, T, K), generator=g) for _ in range(2))
        cq[0, :4] = 1000  # query buckets that no key has (outside the keys' span)
    expected = definition(cq, ck, kv, 10, q, keys)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = topk.topk_by_match(cq, ck, kv, 10, q, keys)
            assert torch.equal(as_sets(got, T), expected), f"{n} thread(s)"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("T", [120, 300])
@pytest.mark.parametrize("groups", [2, 3, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_score_ties_go_to_the_nearer_then_earlier_key(dtype, groups, T, path):
    """All codes equal and keys in groups of equal vectors (key j in group j mod `groups`):
    the match count ties everywhere, the score within a group, and there the position
    decides; with 2 groups the keys i - d and i + d always tie, and an odd k splits a pair.
    T = 300 ties more keys than the CPU kernel ranks by counting (`RANK_MAX`): a quickselect."""
    N, K = 2, 4
    cq = torch.ones(N, T, K, dtype=torch.bool)
    g = torch.Generator().manual_seed(groups)
    keys = torch.randn(N, groups, 3, generator=g, dtype=dtype)[:, torch.arange(T) % groups]
    q = torch.randn(N, T, 3, generator=g, dtype=dtype)
    kv = torch.ones(N, T, dtype=torch.bool)
    for k in (9, 10):
        got = topk.topk_by_match(cq, cq, kv, k, q, keys)
        assert torch.equal(as_sets(got, T), definition(cq, cq, kv, k, q, keys))


@pytest.mark.parametrize("codes", ["sign", "l2"])
def test_many_chunks_and_chunk_offsets(codes, path, monkeypatch):
    """Chunks of a few rows: each chunk's own-key diagonal and positions are offset."""
    monkeypatch.setattr(topk, "_MATCH_CHUNK", 3 * 200)
    cq, ck, kv, q, keys = random_case(3, 200, 5, 4, seed=5)
    if codes == "l2":
        cq, ck = cq.int() + (cq.roll(1, -1).int() << 1), ck.int() + (ck.roll(1, -1).int() << 1)
    for args in ((q, keys), ()):
        got = topk.topk_by_match(cq, ck, kv, 11, *args)
        assert torch.equal(as_sets(got, 200), definition(cq, ck, kv, 11, *args))


@pytest.mark.slow
@pytest.mark.parametrize("codes", ["sign", "l2"])
def test_tensor_path_compiles_to_the_same_keys(codes, monkeypatch):
    """The selection a GPU runs (the tensor path) compiles whole (`fullgraph`: no graph break,
    no host read) and inductor's kernels select the eager path's keys, score ties included."""
    monkeypatch.setattr(topk, "_use_cpu_kernel", lambda t: False)
    torch._dynamo.reset()
    cq, ck, kv, q, keys = random_case(3, 150, 6, 4, seed=7, dtype=torch.float32)
    keys[:, 1::2] = keys[:, ::2]  # equal keys: score ties for the position to break
    if codes == "l2":
        cq, ck = cq.int() + (cq.roll(1, -1).int() << 1), ck.int() + (ck.roll(1, -1).int() << 1)
    compiled = torch.compile(topk.topk_by_match, backend="inductor", fullgraph=True)
    for args in ((q, keys), ()):
        assert torch.equal(
            compiled(cq, ck, kv, 11, *args), topk.topk_by_match(cq, ck, kv, 11, *args)
        )
    torch._dynamo.reset()


def test_float32_scores_and_near_ties(path):
    """float32 inputs whose scores differ by an ulp or two: the per-pair and dense scores
    round as the all-pairs ones do (float64 sums of exact products)."""
    N, T, K = 2, 256, 2
    cq, ck, kv, q, keys = random_case(N, T, K, 8, seed=11, dtype=torch.float32, valid_frac=1)
    keys = keys[:, :1] + 1e-7 * keys  # all keys within a few ulps of each other
    got = topk.topk_by_match(cq, ck, kv, 17, q, keys)
    assert torch.equal(as_sets(got, T), definition(cq, ck, kv, 17, q, keys))


@pytest.mark.parametrize(("q_scale", "key_scale"), [(1e20, 1.0), (1e-25, 1e-20), (1e10, 1e-10)])
def test_scores_beyond_float32_range(q_scale, key_scale, path):
    """float64 scores that float32 cannot hold (overflow, underflow) or holds only in part:
    the CPU kernel's float32 estimates of the tied keys' scores must not drop a key the
    float64 scores keep."""
    cq, ck, kv, q, keys = random_case(2, 200, 3, 6, seed=3, valid_frac=1)
    q, keys = q * q_scale, keys * key_scale
    got = topk.topk_by_match(cq, ck, kv, 13, q, keys)
    assert torch.equal(as_sets(got, 200), definition(cq, ck, kv, 13, q, keys))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_scores_still_select_k_distinct_keys(bad, path):
    """Keys holding NaN or infinity (a diverged model): the CPU kernel's float32 estimates
    bound nothing there, so it must not narrow on them (it once kept fewer keys than slots
    and wrote out of bounds), and the tensor path must order such scores (it once picked
    the out-of-range key T): every row still gets k distinct keys, in increasing order."""
    cq, ck, kv, q, keys = random_case(2, 120, 3, 6, seed=0, dtype=torch.float32, valid_frac=1)
    keys[:, 5::7] = bad
    got = topk.topk_by_match(cq, ck, kv, 13, q, keys)
    assert got.shape == (2, 120, 13) and bool((got[..., 1:] > got[..., :-1]).all())
    assert bool(((got >= 0) & (got < 120)).all())


@pytest.mark.parametrize("tie_break", ["score", "position"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", LSH)
def test_select_equals_selection_dense(name, dtype, tie_break, path):
    """Every variant's `select` against its all-pairs reference `selection_dense`, padded,
    with k above some lengths (k = 6; lengths 40, 23, 4, 1), every row, padded ones too."""
    attn = make(name, tie_break=tie_break, bits=4).to(dtype)
    x, pad = batch([40, 23, 4, 1])
    q, k, _ = attn._qkv(x.to(dtype))
    fast = as_sets(attn.select(q, k, ~pad), 40)
    assert torch.equal(fast, attn.selection_dense(q, k, ~pad))


def test_select_equals_selection_dense_at_bench_shapes(path):
    """16 bits, k = 32, T = 300, float32: the study's settings on random inputs."""
    attn = make("xbox", k=32, bits=16).float()
    x, pad = batch([300, 211], seed=4)
    q, k, _ = attn._qkv(x.float())
    assert torch.equal(as_sets(attn.select(q, k, ~pad), 300), attn.selection_dense(q, k, ~pad))


def test_k_at_least_T_selects_everything(path):
    cq, ck, kv, q, keys = random_case(2, 9, 4, 3, seed=1)
    got = topk.topk_by_match(cq, ck, kv, 50, q, keys)
    assert torch.equal(got, torch.arange(9).expand(2, 9, 9))
    assert HEADS > 0


@pytest.mark.parametrize("name", LSH)
def test_select_equals_selection_dense_on_built_in_corpus_batches(name, tiny_corpus, path):
    """Real inputs: three utterances of the built-in corpus as log-mel features, normalised,
    through a small AALBERT with each scheme at its defaults (16 hashes, k = 32): at every
    layer the fast selection is the all-pairs one, key set for key set, padding included."""
    import soundfile as sf

    from speechattn.data.features import cmvn, log_mel_batch
    from speechattn.model import aalbert

    waves = [sf.read(f, dtype="float32")[0] for f in sorted(tiny_corpus.rglob("*.flac"))[:3]]
    lengths = torch.tensor([len(w) for w in waves])
    wavs = torch.zeros(3, int(lengths.max()))
    for b, w in enumerate(waves):
        wavs[b, : len(w)] = torch.from_numpy(w)
    feats, frames = log_mel_batch(wavs, lengths)
    torch.manual_seed(0)
    model = aalbert(feature_dim=80, dim=64, num_layers=2, num_heads=4, ffn_dim=128, attention=name)
    checked = []

    def check(attn, q, k, valid):  # the layer's own select, compared before it is used
        idx = type(attn).select(attn, q, k, valid)
        assert torch.equal(as_sets(idx, q.shape[-2]), attn.selection_dense(q, k, valid))
        checked.append(valid.sum().item())
        return idx

    for layer in model.encoder.layers:
        layer.attention.select = lambda q, k, valid, attn=layer.attention: check(attn, q, k, valid)
    with torch.no_grad():
        model(cmvn(feats, frames), frames)
    assert len(checked) == 2

"""Facts specific to each family: sparse sets, LDSA locality, LSH codes, synthesizer patterns,
linear attention's formula and memory, Longformer's pattern and long kernel."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _attention_testing import DIM, HEADS, batch, kernels_and_reference, make
from torch.utils._python_dispatch import TorchDispatchMode

from speechattn.attention import Attention, build, lsh, patterns
from speechattn.attention.kernels import sparse_topk, topk

# ---------------------------------------------------------------- shared_qk


def test_shared_qk_self_only_when_alone():
    attn = make("shared_qk")
    x, pad = batch([6, 1], T=6)
    _, w = attn(x, pad, need_weights=True)
    diag = w[0].diagonal(dim1=-2, dim2=-1)
    assert diag.max() < 1e-12  # never itself while other keys exist
    torch.testing.assert_close(w[1, :, 0, 0], torch.ones(HEADS, dtype=w.dtype))  # alone: itself


# ---------------------------------------------------------------- sparse


def _spec_set(name: str, head: int, i: int, j: int, stride: int, summary: int = 1) -> bool:
    """The set definitions of docs/attention.md, written independently of patterns.py."""
    first_half = head < (HEADS + 1) // 2
    if name == "sparse_strided":
        return abs(i - j) <= stride if first_half else (i - j) % stride == 0
    if first_half:
        return i // stride == j // stride
    return j % stride >= stride - min(summary, stride)


@pytest.mark.parametrize("name", ["sparse_strided", "sparse_fixed"])
@pytest.mark.parametrize("stride", [None, 3])
def test_sparse_support_matches_set_definition(name, stride):
    lengths = [20, 11, 4]
    key = "stride" if name == "sparse_strided" else "block"
    options = {key: stride} | ({"summary": 2} if name == "sparse_fixed" else {})
    attn = make(name, **options)
    x, pad = batch(lengths)
    _, w = attn(x, pad, need_weights=True)
    for b, n in enumerate(lengths):
        ls = stride or round(math.sqrt(n))
        for h in range(HEADS):
            support = w[b, h, :n, :n] > 0
            for i in range(n):
                want = {j for j in range(n) if _spec_set(name, h, i, j, ls, 2) and j != i}
                got = {j for j in range(n) if support[i, j] and j != i}
                assert got == want, (b, h, i)
                # the self key is used only when nothing else is allowed
                assert bool(support[i, i]) == (not want)


def test_sparse_default_stride_is_sqrt_of_own_length():
    attn = make("sparse_strided")
    _, pad = batch([100, 30, 2])
    assert attn.strides(~pad) == [10, 5, 1]
    assert make("sparse_strided", stride=7).strides(~pad) == [7, 7, 7]


@pytest.mark.parametrize("name", ["sparse_strided", "sparse_fixed"])
def test_sparse_keys_attended_counts_the_pattern(name):
    attn = make(name)
    for T in (1, 9, 50):
        ls = patterns.default_stride(T)
        pats = attn.pattern_pair(T, ls, torch.device("cpu"))
        hA = (HEADS + 1) // 2
        expected = (
            hA * pats[0].sum(-1).double().mean() + (HEADS - hA) * pats[1].sum(-1).double().mean()
        ) / HEADS
        assert attn.keys_attended(T) == pytest.approx(float(expected))
    assert attn.keys_attended(4096) < 0.1 * 4096


# ---------------------------------------------------------------- ldsa


def test_ldsa_is_local():
    c = 5
    attn = make("ldsa", context=c)
    x, _ = batch([15])
    y = attn(x)
    t = 7
    for s in range(15):
        x2 = x.clone()
        x2[0, s] += 3.0
        changed = not torch.allclose(attn(x2)[0, t], y[0, t], rtol=0, atol=1e-12)
        assert changed == (abs(s - t) <= c // 2), s


def test_ldsa_weights_are_a_renormalised_band():
    attn = make("ldsa", context=5)
    x, pad = batch([8, 3])
    _, w = attn(x, pad, need_weights=True)
    i = torch.arange(8)
    outside = (i[:, None] - i[None, :]).abs() > 2
    assert (w[:, :, outside] == 0).all()
    assert w[1, :, 0, 0].min() > 0 and (w[1, :, 0, 3:] == 0).all()


def test_ldsa_keys_attended_counts_its_window():
    """Every query weighs the c values of its window (renormalised over those inside the
    utterance), so keys_attended is that window's size, not 0 like the synthesizers'."""
    attn = make("ldsa", context=5)
    for T in (1, 3, 8, 40):
        x, _ = batch([T])
        _, w = attn(x, need_weights=True)
        assert attn.keys_attended(T) == pytest.approx(float((w[0] > 0).sum(-1).double().mean()))
    assert attn.keys_attended(4) == pytest.approx(14 / 4)  # 3, 4, 4, 3 keys: the window is cut
    assert build("ldsa", DIM, HEADS).keys_attended(1000) == pytest.approx(15 - 7 * 8 / 1000)


def test_ldsa_context_must_be_odd():
    with pytest.raises(ValueError, match="odd"):
        make("ldsa", context=4)


# ---------------------------------------------------------------- lsh

LSH = ["sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh"]


def _qkm(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = (
        torch.randn(2, 3, 40, 8, generator=g, dtype=torch.float64)
        * torch.rand(2, 3, 40, 1, generator=g, dtype=torch.float64)
        * 4
    )
    M = q.norm(dim=-1, keepdim=True).amax(-2, keepdim=True)
    R = torch.randn(9, 64, generator=g, dtype=torch.float64)
    return q, M, R


def test_xbox_qnf_and_simple_lsh_give_identical_codes():
    q, M, R = _qkm()
    codes = [
        tuple(lsh.sign_codes(z, R) for z in f(q, q, M))
        for f in (lsh.xbox, lsh.xbox_qnf, lsh.simple_lsh)
    ]
    for cq, ck in codes[1:]:
        assert torch.equal(cq, codes[0][0]) and torch.equal(ck, codes[0][1])


def test_sign_alsh_with_and_without_qnf_identical():
    q, M, _ = _qkm(1)
    R = torch.randn(10, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    a = [lsh.sign_codes(z, R) for z in lsh.sign_alsh(q, q, M)]
    b = [lsh.sign_codes(z, R) for z in lsh.sign_alsh(q, q, M, qnf=True)]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_equivalent_lsh_variants_give_identical_outputs():
    """Under sign hashes xbox, xbox_qnf and simple_lsh are one model (`lsh.same_model` says
    so); under each scheme's own hash the five schemes are five models."""
    x, pad = batch([20, 12])
    ref = make("xbox", hash="sign")
    for name in ("xbox_qnf", "simple_lsh"):
        other = make(name, hash="sign")
        other.load_state_dict(ref.state_dict())
        torch.testing.assert_close(other(x, pad), ref(x, pad), rtol=0, atol=0)
        assert lsh.same_model(ref, other)
    defaults = [make(name) for name in LSH]
    for i, a in enumerate(defaults):
        assert [lsh.same_model(a, b) for b in defaults] == [j == i for j in range(len(LSH))]
    assert not lsh.same_model(ref, make("simple_lsh", hash="sign", k=7))  # options differ


@pytest.mark.parametrize("name", LSH)
def test_lsh_attends_min_k_valid_keys(name):
    lengths = [20, 5, 1]
    attn = make(name, k=6)
    x, pad = batch(lengths)
    q, k, _ = attn._qkv(x.masked_fill(pad[..., None], 0))
    valid = ~pad
    idx = attn.select(q, k, valid)  # (B, h, T, kk)
    sel = attn.selection_dense(q, k, valid)  # (B, h, T, T)
    fast = torch.zeros_like(sel).scatter(-1, idx, True)
    eye = torch.eye(x.shape[1], dtype=torch.bool)
    for b, n in enumerate(lengths):
        others = sel[b, :, :n, :n] & ~eye[:n, :n]
        assert (others.sum(-1) == min(6, n - 1)).all()  # k other keys, fewer only if there are
        # self is kept only to fill a top-k that the other valid keys cannot
        assert torch.equal(
            sel[b, :, :n, :n].diagonal(dim1=-2, dim2=-1).all(-1), torch.tensor([n <= 6] * HEADS)
        )
        assert torch.equal(fast[b, :, :n, :n], sel[b, :, :n, :n])  # fast top-k == reference
        # padded keys only fill the top-k when fewer than k keys are valid (masked later)
        assert (sel[b, :, :n, n:].sum(-1) == idx.shape[-1] - min(6, n)).all()


@pytest.mark.parametrize("name", LSH)
@pytest.mark.parametrize("limit", [10**6, 0])  # short path, sparse path
def test_lsh_weights_min_k_other_keys_self_only_when_alone(name, limit, monkeypatch):
    """Each valid query gives nonzero weight to exactly min(k, n - 1) keys other than itself
    and none to itself, unless it is alone (n = 1): then all its weight is on itself."""
    monkeypatch.setattr(type(make(name)), "short_path_max_t", limit)
    lengths = [20, 5, 1]
    attn = make(name, k=6)
    x, pad = batch(lengths)
    _, w = attn.dense_reference(x, pad)  # (B, h, T, T)
    eye = torch.eye(x.shape[1], dtype=torch.bool)
    for b, n in enumerate(lengths):
        wb = w[b, :, :n, :n]
        assert ((wb > 0) & ~eye[:n, :n]).sum(-1).eq(min(6, n - 1)).all()
        diag = wb.diagonal(dim1=-2, dim2=-1)
        if n == 1:
            torch.testing.assert_close(diag, torch.ones_like(diag))
        else:
            assert diag.max() < 1e-12
    torch.testing.assert_close(attn(x, pad), attn.dense_reference(x, pad)[0])


@pytest.mark.parametrize("name", LSH)
def test_lsh_is_deterministic_across_modes_calls_and_instances(name):
    x, pad = batch([20, 12])
    attn = make(name)
    y = attn(x, pad)
    torch.testing.assert_close(attn(x, pad), y, rtol=0, atol=0)
    attn.train()
    torch.testing.assert_close(attn(x, pad), y, rtol=0, atol=0)
    assert "projection" in attn.state_dict()
    twin = make(name, torch_seed=123)  # other weights, same hashing seed (option default)
    assert torch.equal(twin.projection, attn.projection)


@pytest.mark.parametrize("name", LSH)
def test_lsh_sparse_and_short_paths_agree(name, monkeypatch):
    """Both kernels behind `attend` (all-pairs scores masked to the selection below
    `short_path_max_t`, CSR products above) give the dense reference's outputs and
    gradients; the tiny lengths here would otherwise only reach the first."""
    x, pad = batch([20, 12, 1])
    results = kernels_and_reference(lambda: make(name), x, pad, "qv.weight", monkeypatch)
    for got in results[:2]:
        for a, b in zip(got, results[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("limit", [10**6, 0])  # short path, sparse path (gathered keys)
def test_lsh_dropout_in_training_runs_on_both_paths(limit, monkeypatch):
    """Attention dropout needs the weights: above `short_path_max_t` it takes the gathered
    (unfused) path, below it the masked all-pairs one. Both train, pad with zeros, and with the
    dropout off in eval mode equal the dense reference."""
    monkeypatch.setattr(lsh.XBOXAttention, "short_path_max_t", limit)
    attn = make("xbox", dropout=0.5).train()
    x, pad = batch([20, 12])
    torch.manual_seed(0)
    y = attn(x, pad)
    y.sum().backward()
    assert torch.isfinite(y).all() and (y[pad] == 0).all()
    assert attn.qv.weight.grad is not None
    attn.eval()
    torch.testing.assert_close(attn(x, pad), attn.dense_reference(x, pad)[0])


def test_lsh_seed_changes_projection():
    a = build("xbox", DIM, HEADS, seed=0).projection
    assert torch.equal(a, build("xbox", DIM, HEADS, seed=0).projection)
    assert not torch.equal(a, build("xbox", DIM, HEADS, seed=1).projection)


def test_lsh_layers_hash_differently_and_reproducibly():
    """Unshared layers get their own projection, derived from the layer index: the same for
    every build of the model (so train and eval hash alike), different between layers."""
    from speechattn.model.aalbert import AALBERT, ModelConfig

    def projections(seed: int = 0) -> list[torch.Tensor]:
        config = ModelConfig(
            dim=32, num_heads=4, ffn_dim=64, num_layers=3, shared=False,
            attention="xbox", attention_options={"seed": seed},
        )  # fmt: skip
        torch.manual_seed(seed + 1)  # other weights: the hashing must not depend on them
        return [layer.attention.projection for layer in AALBERT(config).encoder.layers]

    first = projections()
    assert len(first) == 3
    for a, b in zip(first, projections(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    assert not torch.equal(first[0], projections(seed=1)[0])


def test_lsh_tie_break_prefers_near_then_early_and_self_last():
    # all codes equal: every key ties, so the k nearest other keys win, earlier first at equal
    # distance; the query's own key comes last
    cq = torch.ones(1, 9, 4, dtype=torch.bool)
    kv = torch.ones(1, 9, dtype=torch.bool)
    idx = topk.topk_by_match(cq, cq, kv, 3)[0]
    assert sorted(idx[4].tolist()) == [2, 3, 5]
    assert sorted(topk.topk_by_match(cq, cq, kv, 2)[0][4].tolist()) == [3, 5]
    assert sorted(idx[0].tolist()) == [1, 2, 3]
    assert sorted(topk.topk_by_match(cq, cq, kv, 9)[0][4].tolist()) == list(range(9))


# ---------------------------------------------------------------- synthesizers


@pytest.mark.parametrize("name", ["syn_dense", "syn_dense_mh", "syn_random", "syn_fixed"])
def test_synthesizer_rejects_sequences_longer_than_max_len(name):
    attn = make(name, max_len=8)
    x, _ = batch([9])
    with pytest.raises(ValueError, match="max_len=8"):
        attn(x)
    assert attn(x[:, :8]).shape == (1, 8, DIM)


def test_syn_fixed_initial_weights_follow_the_patterns():
    torch.manual_seed(0)
    attn = build("syn_fixed", DIM, 8, max_len=64).double()  # 7 pattern heads + 1 random
    assert torch.equal(attn.logits[:7], build("syn_fixed", DIM, 8, max_len=64).logits[:7].double())
    lengths = [20, 13]
    x, pad = batch(lengths)
    _, w = attn(x, pad, need_weights=True)
    for b, n in enumerate(lengths):
        wb = w[b, :, :n, :n]
        for i in range(n):
            assert wb[0, i].argmax() == i  # current
            if i > 0:
                assert wb[1, i].argmax() == i - 1  # previous
                assert wb[3, i, max(0, i - 3) : i].sum() > 0.9  # left context
            if i < n - 1:
                assert wb[2, i].argmax() == i + 1  # next
                assert wb[4, i, i + 1 : i + 4].sum() > 0.9  # right context
            assert wb[5, i].argmax() == 0  # start: own first frame
            assert wb[6, i].argmax() == n - 1  # end: own last valid frame, not T - 1
            assert wb[6, i, n - 1] > 0.9
    # the patterns dominate: weights of the intended key near 1
    assert w[0, 0].diagonal().min() > 0.99


def test_syn_fixed_with_fewer_heads_keeps_first_patterns():
    attn = build("syn_fixed", 16, 2, max_len=16)
    assert attn.pattern_names == ("current", "previous")
    y = attn(torch.randn(1, 5, 16))
    assert y.shape == (1, 5, 16)


def test_fixed_patterns_rows():
    p = patterns.fixed_patterns(6, context=2)
    assert p.shape == (7, 6, 6)
    torch.testing.assert_close(p[3, 4], torch.tensor([0, 0, 0.5, 0.5, 0, 0]))
    assert p[1, 0].sum() == 0 and p[2, 5].sum() == 0  # no previous of the first frame etc.


def test_syn_fixed_end_head_fast_path_matches_reference_with_padding():
    torch.manual_seed(0)
    attn = build("syn_fixed", DIM, 8, max_len=24).double()
    with torch.no_grad():
        attn.logits.add_(torch.randn_like(attn.logits))  # leave the initial patterns
    x, pad = batch([20, 13, 20])
    for xb, pb in ((x, pad), (x[1:2, :13], None)):  # per-utterance slices; one slice for B = 1
        w = torch.randn(xb.shape, dtype=x.dtype)
        grads = []
        for fast in (True, False):
            attn.zero_grad()
            xi = xb.clone().requires_grad_(True)
            y = attn(xi, pb) if fast else attn.dense_reference(xi, pb)[0]
            (y * w).sum().backward()
            grads.append((y.detach(), xi.grad, attn.logits.grad.clone()))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(attn(x, pad)[1:2, :13], attn(x[1:2, :13]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("T", "k"), [(300, 4), (257, 9), (64, 32)])
def test_pruned_topk_equals_exact_sort(T, k):
    g = torch.Generator().manual_seed(T)
    cq = torch.rand(3, T, 6, generator=g) > 0.5  # few bits: many ties, tie-break matters
    ck = torch.rand(3, T, 6, generator=g) > 0.5
    kv = torch.rand(3, T, generator=g) > 0.3
    kv[2, 5:] = False  # fewer valid keys than k for one row
    got = torch.zeros(3, T, T, dtype=torch.bool).scatter(
        -1, topk.topk_by_match(cq, ck, kv, k), True
    )
    match = (cq[:, :, None] == ck[:, None]).sum(-1)
    i = torch.arange(T)
    rank = 2 * (i[:, None] - i[None]).abs() + (i[None] > i[:, None]).long()
    own = torch.eye(T, dtype=torch.long) * 4 * T * 7  # below every other allowed key
    key = match * 4 * T - rank - own - (~kv)[:, None, :] * 4 * T * 20
    want = torch.zeros_like(got).scatter(-1, key.argsort(-1, descending=True)[..., :k], True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernel", ["cpu", "csr"])
def test_sparse_topk_attention_gradcheck(kernel, monkeypatch):
    """Both kernels: the CPU's numba one and the CSR products GPUs run."""
    monkeypatch.setattr(sparse_topk, "_use_cpu_kernel", lambda t: kernel == "cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 7, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    idx = torch.stack([torch.randperm(7, generator=g)[:4] for _ in range(14)]).view(2, 7, 4)
    allowed = torch.rand(2, 7, 4, generator=g) > 0.2
    assert torch.autograd.gradcheck(
        lambda *t: sparse_topk.sparse_topk_attention(*t, idx, allowed, 0.5), (q, k, v)
    )


@pytest.mark.parametrize("name", ["syn_random", "syn_fixed"])
@pytest.mark.parametrize("max_len", [20, 24, 80])  # windows cover all, most, a sixteenth
def test_table_kernel_gradient_whatever_the_window_covers(name, max_len, monkeypatch):
    """The long-sequence table kernel writes the logits' gradient into fresh OS-zeroed memory
    whether the T x T windows cover all, most or little of the table: it equals the dense
    reference's gradient, zeros included."""
    monkeypatch.setattr(type(make(name)), "short_path_max_t", 0)
    torch.manual_seed(0)
    attn = build(name, DIM, HEADS, max_len=max_len).double()
    x, _ = batch([20, 20])
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=x.dtype)
    grads = []
    for dense in (False, True):
        attn.zero_grad()
        y = attn.dense_reference(x)[0] if dense else attn(x)
        (y * w).sum().backward()
        grads.append(attn.logits.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
    assert (grads[0][:, 20:] == 0).all() and (grads[0][:, :, 20:] == 0).all()


@pytest.mark.parametrize("limit", [10**6, 0])  # explicit weights, table kernel
def test_table_gradient_memory_is_reused_only_once_released(limit, monkeypatch):
    """The logits' gradient memory comes back, zeroed, once `.grad` has let go of it; while
    `.grad` still holds it (accumulation) a step gets other memory and the gradients add."""
    monkeypatch.setattr(type(make("syn_random")), "short_path_max_t", limit)
    attn = build("syn_random", DIM, HEADS, max_len=24).double()
    x, _ = batch([20, 20])

    def step(weight: float = 1.0) -> None:
        (weight * attn(x).pow(2).sum()).backward()

    step()
    first, memory = attn.logits.grad.clone(), attn.logits.grad.data_ptr()
    attn.zero_grad()  # set_to_none, as optimizers do
    step()
    assert attn.logits.grad.data_ptr() == memory  # the same pages, not fresh ones
    torch.testing.assert_close(attn.logits.grad, first, rtol=0, atol=0)
    step(3.0)  # no zero_grad: the held gradient must not be handed out again
    assert attn.logits.grad.data_ptr() == memory
    torch.testing.assert_close(attn.logits.grad, 4 * first, rtol=1e-12, atol=0)
    assert copy.deepcopy(attn).gradient_memory.array is None


# ---------------------------------------------------------------- linear


def _merged_heads(attn, x, pad):
    """Per-head outputs of the efficient path, merged (B, T, D): the input of W^O."""
    seen = {}
    hook = attn.out_proj.register_forward_hook(lambda m, inp, out: seen.update(merged=inp[0]))
    attn(x, pad)
    hook.remove()
    return seen["merged"]


def test_linear_equals_the_papers_formula():
    """y_i = phi(q_i)^T sum_j phi(k_j) v_j^T / (phi(q_i)^T sum_j phi(k_j)), j over valid keys,
    written per utterance and head with an explicit loop over the keys."""
    lengths = [11, 6, 1]
    attn = make("linear")
    x, pad = batch(lengths)
    merged = _merged_heads(attn, x, pad)
    dk = DIM // HEADS
    for b, n in enumerate(lengths):
        q, k, v = attn.qkv(x[b, :n]).chunk(3, dim=-1)  # (n, D) each
        for h in range(HEADS):
            cols = slice(h * dk, (h + 1) * dk)
            phi_q = torch.nn.functional.elu(q[:, cols]) + 1  # (n, d_k)
            phi_k = torch.nn.functional.elu(k[:, cols]) + 1
            num = sum(torch.outer(phi_k[j], v[j, cols]) for j in range(n))  # (d_k, d_k)
            den = sum(phi_k[j] for j in range(n))  # (d_k,)
            want = (phi_q @ num) / (phi_q @ den)[:, None]  # (n, d_k)
            torch.testing.assert_close(merged[b, :n, cols], want, rtol=1e-10, atol=1e-12)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_linear_efficient_path_never_forms_t_by_t():
    """Forward and backward at T = 600: no tensor reaches T^2 = 360k elements (the largest are
    the (B, T, 3D) projections), while the dense reference forms (B, h, T, T)."""
    attn = make("linear")
    x, pad = batch([600, 450])
    x.requires_grad_(True)
    with _LargestTensor() as mode:
        attn(x, pad).sum().backward()
    assert mode.numel <= 2 * 600 * 3 * DIM < 600 * 600
    with _LargestTensor() as mode:
        attn.dense_reference(x, pad)
    assert mode.numel >= 2 * HEADS * 600 * 600


def test_linear_dropout_drops_key_columns_in_both_paths():
    """Training-time dropout leaves whole keys out of the numerator (the same mask for every
    query, drawn once per call): from one seed both paths give the same output, and it differs
    from the eval output."""
    attn = make("linear", dropout=0.5).train()
    x, pad = batch([12, 7])
    torch.manual_seed(0)
    y = attn(x, pad)
    torch.manual_seed(0)
    y_ref, _ = attn.dense_reference(x, pad)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(y, attn.eval()(x, pad))


def test_linear_kernel_gradients_under_dropout_and_padding():
    """The hand-written backward of the efficient path equals autograd through the dense
    reference (inputs and every parameter), with a key-column dropout mask drawn from one seed."""
    attn = make("linear", dropout=0.5).train()
    x, pad = batch([12, 7, 1])
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    grads = []
    for path in ("fast", "dense"):
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(0)
        y = attn(xi, pad) if path == "fast" else attn.dense_reference(xi, pad)[0]
        grads.append(torch.autograd.grad((y * w).sum(), [xi, *attn.parameters()]))
    for fast, dense in zip(*grads, strict=True):
        torch.testing.assert_close(fast, dense, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_linear_long_sums_stay_in_float32_under_autocast(dtype):
    """At T = 100k the normaliser z = sum_j phi(k_j) exceeds float16's range (6.5e4): the
    sums run in float32, so the output is finite and close to float32's, in the caller's dtype."""
    torch.manual_seed(0)
    attn = build("linear", DIM, HEADS).eval()
    x = torch.randn(1, 100_000, DIM, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = attn(x)
        _, k, _ = attn._qkv(x)
        assert (torch.nn.functional.elu(k) + 1).sum(-2).max() > 7e4  # z overflows float16
        with torch.autocast("cpu", dtype=dtype):
            y = attn(x)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


# ---------------------------------------------------------------- longformer


def _longformer_set(head: int, i: int, j: int, w: int, delta: int, g: int, dilated: int) -> bool:
    """The pattern of docs/attention.md, written independently of patterns.py and the kernels."""
    if g and (i % g == 0 or j % g == 0):
        return True
    if head < HEADS - dilated:
        return abs(i - j) <= w
    return abs(i - j) <= w * delta and (i - j) % delta == 0


@pytest.mark.parametrize(
    "options",
    [
        {"window": 2, "dilation": 3, "global_every": 7},
        {"window": 3, "dilation": 2, "global_every": 0, "dilated_heads": 1},
        {"window": 1, "dilation": 4, "global_every": 5, "dilated_heads": 4},
    ],
)
def test_longformer_support_matches_the_definition(options):
    lengths = [23, 12, 1]
    attn = make("longformer", **options)
    x, pad = batch(lengths)
    _, weights = attn(x, pad, need_weights=True)
    w, delta, g = options["window"], options["dilation"], options["global_every"]
    dilated = options.get("dilated_heads", HEADS // 2)
    for b, n in enumerate(lengths):
        for h in range(HEADS):
            want = torch.tensor(
                [
                    [_longformer_set(h, i, j, w, delta, g, dilated) for j in range(n)]
                    for i in range(n)
                ]
            )
            assert torch.equal(weights[b, h, :n, :n] > 0, want), (b, h)
        assert attn.keys_attended(n) == pytest.approx(
            float((weights[b, :, :n] > 0).sum(-1).double().mean())
        )


@pytest.mark.parametrize("options", [{}, {"window": 4, "dilation": 3, "global_every": 0}])
def test_longformer_long_kernel_equals_reference_at_length(options, monkeypatch):
    """At T in the hundreds (many blocks, classes and global frames; the defaults: w = 16,
    delta = 4, g = 64), both kernels give the dense reference's outputs and gradients."""
    x, pad = batch([300, 181, 64, 1])

    def defaults() -> Attention:
        torch.manual_seed(0)
        return build("longformer", DIM, HEADS, **options).double()

    results = kernels_and_reference(defaults, x, pad, "qkv.weight", monkeypatch)
    for got in results[:2]:
        for a, b in zip(got, results[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_longformer_long_kernel_never_forms_t_by_t(monkeypatch):
    monkeypatch.setattr(type(make("longformer")), "short_path_max_t", 0)
    attn = make("longformer", window=4, global_every=64)
    x, pad = batch([600, 450])
    x.requires_grad_(True)
    with _LargestTensor() as mode:
        attn(x, pad).sum().backward()
    assert mode.numel < 600 * 600


def test_longformer_keys_attended_at_the_defaults():
    """O(T w) counting equals the (T, T) pattern's mean row size; at T = 4096 about 2w + 1 = 33
    window keys, plus 64 global columns, plus the 64 global rows' 4096 keys spread over all."""
    attn = build("longformer", DIM, HEADS)
    pattern = attn.pattern(torch.ones(1, 300, dtype=torch.bool))  # (1, h, T, T)
    assert attn.keys_attended(300) == pytest.approx(float(pattern.sum(-1).double().mean()))
    assert 33 + 64 + 64 - 3 < attn.keys_attended(4096) < 33 + 64 + 64
    assert build("longformer", DIM, HEADS, global_every=0).keys_attended(4096) < 33


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window": 0}, "window w must be >= 1"),
        ({"dilation": 0}, "dilation must be >= 1"),
        ({"dilated_heads": HEADS + 1}, r"dilated_heads must be in \[0, num_heads=4\]"),
        ({"global_every": -1}, "global_every must be >= 0"),
    ],
)
def test_longformer_rejects_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        build("longformer", DIM, HEADS, **options)


@pytest.mark.parametrize("max_len", [64, 1024])
def test_syn_fixed_patterns_hold_their_mass_at_every_length(max_len):
    """At initialisation each pattern row whose targets lie inside the utterance holds
    init_mass (0.99) of its weight at T = max_len and more at shorter T (eps from max_len); a
    fixed eps = 1e-4 held 0.91 at T = 1024. Rows whose targets run past a shorter utterance's
    end hold exactly what docs/attention.md states."""
    from speechattn.attention import synthesizer

    def masses(attn, T: int) -> torch.Tensor:  # (h_pat, rows with a target) pattern mass
        x = torch.zeros(1, T, DIM, dtype=torch.float64)
        _, w = attn(x, need_weights=True)
        pat = torch.stack([patterns.fixed_pattern(n, T) for n in attn.pattern_names]) > 0
        if "end" in attn.pattern_names:  # read from the bottom-right corner: last column
            pat[attn.pattern_names.index("end")] = patterns.fixed_pattern("end", T) > 0
        mass = (w[0, : len(pat)] * pat).sum(-1)  # (h_pat, T)
        return mass[pat.any(-1)]

    attn = make("syn_fixed", max_len=max_len)
    at_max = masses(attn, max_len)
    assert at_max.min() >= 0.99 - 1e-9 and at_max.min() < 0.99 + 1e-6  # one-key rows: 0.99
    assert masses(attn, max_len // 4).min() > 0.99
    assert attn.eps == pytest.approx(synthesizer.pattern_eps(0.99, max_len))
    if max_len == 1024:  # right context near the end of a shorter utterance (T = 1000): a
        # row with j of its 3 targets inside holds (j/3 + j eps) / (j/3 + T eps), as documented
        T, eps = 1000, attn.eps
        seven = build("syn_fixed", DIM, 8, max_len=max_len).double().eval()  # every pattern
        _, w = seven(torch.zeros(1, T, DIM, dtype=torch.float64), need_weights=True)
        right = w[0, seven.pattern_names.index("right")]  # (T, T)
        for j, row in ((1, T - 2), (2, T - 3)):
            held = float(right[row, row + 1 :].sum())
            assert held == pytest.approx(
                (j / 3 + j * eps) / (j / 3 + T * eps), rel=1e-6
            )  # f32 logits
        assert float(right[T - 2, T - 1 :].sum()) == pytest.approx(0.971, abs=5e-4)
        torch.testing.assert_close(right[T - 1], torch.full_like(right[T - 1], 1 / T))
        fixed = make("syn_fixed", max_len=max_len, eps=1e-4)
        assert float(masses(fixed, max_len).min()) == pytest.approx(1.0001 / 1.1024, rel=1e-6)

"""adaptive_span: the soft mask, its two kernels, the learnable clamped spans and their penalty."""

from __future__ import annotations

import pytest
import torch
from _attention_testing import (
    DIM,
    GRAD_TOLERANCE,
    HEADS,
    OUTPUT_TOLERANCE,
    batch,
    make,
    rel_error,
    train_pass,
)
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from speechattn.attention import adaptive_span, build
from speechattn.errors import ConfigError

SPANS = [0.0, 0.25, 0.6, 1.0]  # z / S per head: no span, short, longer, the maximum


def _with_spans(**options) -> torch.nn.Module:
    attn = make("adaptive_span", **options)
    with torch.no_grad():
        attn.span_fraction.copy_(torch.tensor(SPANS, dtype=torch.float64))
    return attn


def test_weights_follow_the_paper_with_absolute_distance():
    attn = _with_spans()  # S = 8, R = 2
    x, pad = batch([15, 9])
    _, w = attn(x, pad, need_weights=True)
    q, k, _ = attn._qkv(x)
    T = x.shape[1]
    probs = (
        (q @ k.transpose(-1, -2) / (k.shape[-1] ** 0.5))
        .masked_fill(pad[:, None, None, :], float("-inf"))
        .softmax(-1)
    )  # (B, h, T, T)
    for h, frac in enumerate(SPANS):
        z = 8 * frac
        for i in range(T):
            for j in range(T):
                m = min(max((2 + z - abs(i - j)) / 2, 0.0), 1.0)
                probs[:, h, i, j] *= m
    total = probs.sum(-1, keepdim=True).clamp_min(1e-300)  # padded queries: 0, not NaN
    expected = probs / total * (~pad)[:, None, :, None]
    torch.testing.assert_close(w, expected, rtol=1e-10, atol=1e-12)
    assert w[0, 0, 7, 7 + 2] == 0 and w[0, 0, 7, 7 + 1] > 0  # z = 0, R = 2: reach 1
    assert w[0, 1, 7, 7 + 4] == 0 and w[0, 1, 7, 7 + 3] > 0  # z = 2, R = 2: reach 3


@pytest.mark.parametrize("T", [47, 67])
def test_band_kernel_equals_all_pairs(T, monkeypatch):
    """Forward and gradients (spans included) of the band of blocks and of all pairs agree."""
    attn = _with_spans(max_span=12, ramp=3)
    x, pad = batch([T, T - 11, 5])  # 3 X < T: the band kernel really runs
    results = []
    for limit in (10**6, 0):  # all pairs, band (reach ceil(12 + 3) - 1 = 14)
        monkeypatch.setattr(type(attn), "short_path_max_t", limit)
        attn.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = attn(xi, pad)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
        results.append((y.detach(), xi.grad, attn.span_fraction.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert attn.reach() == 14 and 3 * attn.reach() < T


def test_spans_are_learnable_and_clamped():
    attn = make("adaptive_span", max_span=8, ramp=2, init_span=0.5)
    # z = S / 2 = 4, moved half a frame off the integer (`initial_span`)
    torch.testing.assert_close(attn.spans(), torch.full((HEADS,), 4.5, dtype=torch.float64))
    x, pad = batch([12, 7])
    attn(x, pad).pow(2).sum().backward()
    assert attn.span_fraction.grad.abs().min() > 0  # every head's span receives a gradient
    with torch.no_grad():
        attn.span_fraction.copy_(torch.tensor([-0.5, 0.0, 1.0, 3.0]))
    assert attn.spans().tolist() == [0.0, 0.0, 8.0, 8.0]
    assert attn.reach() == 9  # ceil(8 + 2) - 1
    attn.after_optimizer_step()  # the paper's projection: the parameter itself back in range
    assert attn.span_fraction.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert build("full", 32, 4).auxiliary_loss() is None  # other variants: no hooks to honour


def test_auxiliary_loss_is_the_l1_penalty_and_shrinks_spans():
    attn = _with_spans(span_penalty=1e-3)
    z = torch.tensor(SPANS, dtype=torch.float64) * 8
    torch.testing.assert_close(attn.auxiliary_loss(), 1e-3 * z.mean())
    attn.auxiliary_loss().backward()
    assert (attn.span_fraction.grad > 0).all()  # gradient descent makes every span shorter


def test_keys_attended_counts_nonzero_mask_entries():
    attn = _with_spans()
    x, _ = batch([13])
    _, w = attn(x, need_weights=True)
    assert attn.keys_attended(13) == pytest.approx(float((w > 0).sum(-1).double().mean()))
    assert attn.keys_attended(1) == 1.0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_span": 0}, "max_span >= 1"),
        ({"ramp": 0}, "ramp >= 2"),
        ({"init_span": 1.5}, "init_span"),
        ({"span_penalty": -1.0}, "span_penalty"),
    ],
)
def test_invalid_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        build("adaptive_span", 32, 4, **options)


@pytest.mark.parametrize("T", [20, 47])  # all pairs; the band of blocks (3 X < T)
def test_fixed_spans_take_flash_backward_and_agree(T, monkeypatch):
    """With the spans frozen the CPU kernels skip FlashThenUnfused (flash's own backward):
    outputs and input gradients equal those of learnable spans."""
    results = []
    for learn in (True, False):
        attn = _with_spans(max_span=12, ramp=3)
        attn.span_fraction.requires_grad_(learn)
        monkeypatch.setattr(type(attn), "short_path_max_t", 30)
        x, pad = batch([T, T - 9])
        x.requires_grad_(True)
        y = attn(x, pad)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
        results.append((y.detach(), x.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_attention_dropout_trains_spans_through_sdpa():
    """Attention dropout (which CPU flash does not draw) keeps the SDPA kernel: dropout acts in
    training and the spans still receive a gradient."""
    attn = _with_spans(dropout=0.5).train()
    x, pad = batch([15, 9])
    torch.manual_seed(0)
    y = attn(x, pad)
    y.pow(2).sum().backward()
    assert attn.span_fraction.grad.abs().max() > 0
    assert not torch.allclose(y, attn.eval()(x, pad))


@pytest.mark.parametrize(
    ("block", "scores", "limit"),
    [(5, 1 << 22, 10**6), (16, 1 << 22, 10**6), (128, 1 << 22, 10**6), (5, 1, 10**6), (5, 1, 0)],
)  # all pairs: many query blocks, a few, one; one batch entry per pass; the band, likewise
def test_blocked_backward_equals_dense_reference(block, scores, limit, monkeypatch):
    """The backward in query blocks against the keys within reach (reversed keys, windows
    clipped at both ends, padding), in passes over the batch, gives the dense reference's
    gradients."""
    from speechattn.attention.kernels.span import FlashThenUnfused

    monkeypatch.setattr(FlashThenUnfused, "backward_block", block)
    monkeypatch.setattr(FlashThenUnfused, "backward_scores", scores)
    attn = _with_spans(max_span=12, ramp=3)  # reach 14
    monkeypatch.setattr(type(attn), "short_path_max_t", limit)
    monkeypatch.setattr(type(attn), "saved_weights_max_t", 0)
    _assert_equals_dense_reference(attn, [47, 30, 3])
    assert attn.reach() == 14


@pytest.mark.parametrize("saved", [True, False], ids=["saved-weights", "flash-then-unfused"])
@pytest.mark.parametrize("lengths", [[47, 30, 3], [40]], ids=["padded", "unpadded"])
def test_all_pairs_cpu_kernels_equal_dense_reference(saved, lengths, monkeypatch):
    """Both all-pairs CPU kernels (keys in order with the weights kept; keys reversed with
    flash's forward) give the dense reference's output and gradients, the spans' included."""
    from speechattn.attention.kernels.span import FlashThenUnfused, UnfusedSavedWeights

    attn = _with_spans(max_span=12, ramp=3)
    monkeypatch.setattr(type(attn), "short_path_max_t", 10**6)
    monkeypatch.setattr(type(attn), "saved_weights_max_t", 10**6 if saved else 0)
    used = []
    for kernel in (FlashThenUnfused, UnfusedSavedWeights):
        monkeypatch.setattr(kernel, "apply", _recording(kernel.apply, kernel, used))
    _assert_equals_dense_reference(attn, lengths)
    assert used == [UnfusedSavedWeights if saved else FlashThenUnfused]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_then_unfused_all_pairs_under_autocast(dtype, monkeypatch):
    """The all-pairs kernel above `saved_weights_max_t` (flash forward, reversed keys) trains
    under autocast within the registry's tolerance of float32 (test_precision runs the other
    two CPU kernels: the saved-weights one as the short kernel, the band as the long one)."""
    attn = build("adaptive_span", DIM, HEADS, max_span=12, ramp=3)
    monkeypatch.setattr(type(attn), "short_path_max_t", 10**6)
    monkeypatch.setattr(type(attn), "saved_weights_max_t", 0)
    x, pad = batch([20, 13, 1])
    x = x.float()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    y32, gx32, gp32 = train_pass(attn, x, pad, w)
    y, gx, gp = train_pass(attn, x, pad, w, dtype)
    assert y.dtype == dtype and rel_error(y, y32) < OUTPUT_TOLERANCE[dtype]
    assert rel_error(gx, gx32) < GRAD_TOLERANCE[dtype]
    for n in gp32:
        assert rel_error(gp[n], gp32[n]) < GRAD_TOLERANCE[dtype], n


def _assert_equals_dense_reference(attn, lengths: list[int]) -> None:
    """Output and gradients (input, spans, projection) of the efficient path and the dense
    reference agree in float64."""
    x, pad = batch(lengths)
    w = torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view(x.shape)
    results = []
    for dense in (False, True):
        attn.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = attn.dense_reference(xi, pad)[0] if dense else attn(xi, pad)
        (y * w).sum().backward()
        results.append((y.detach(), xi.grad, attn.span_fraction.grad.clone(), attn.qkv.weight.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _recording(apply, kernel, used):
    def wrapped(*args):
        used.append(kernel)
        return apply(*args)

    return wrapped


class _HostReads(TorchDispatchMode):
    """Counts reads of tensor data on the host (`.item()`, `float(t)`, `bool(t)`): on a GPU
    each is a host-device sync."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("limit", [10**6, 0], ids=["all-pairs", "band"])
@pytest.mark.parametrize("lengths", [[47, 30, 3], [47, 47]], ids=["padded", "unpadded"])
def test_static_branch_equals_dense_reference_without_host_reads(limit, lengths, monkeypatch):
    """The branch CUDA and torch.compile take: the reach bounded from the options (S + R - 1 =
    14 here, above the spans' 10), SDPA under the log-mask, padding masked without asking
    whether there is any. Same output and gradients as the dense reference, and no read of
    device data on the host in the forward."""
    attn = make("adaptive_span", max_span=12, ramp=3)
    with torch.no_grad():
        attn.span_fraction.copy_(torch.tensor([0.0, 0.25, 0.5, 0.6], dtype=torch.float64))
    assert attn.reach() == 10 and attn.reach(static=True) == 14 and 3 * 14 < 47  # band runs
    monkeypatch.setattr(adaptive_span, "needs_static_shapes", lambda t: True)
    monkeypatch.setattr(type(attn), "short_path_max_t", limit)
    x, pad = batch(lengths)
    padding = pad if len(set(lengths)) > 1 else None  # None: no frame padded
    with _HostReads() as reads:
        attn(x, padding)
    assert reads.count == 0
    _assert_equals_dense_reference(attn, lengths)


@pytest.mark.slow
def test_compiles_in_one_graph_without_recompiling_as_spans_learn():
    """torch.compile (AOTAutograd, forward and backward) traces the whole module in one graph,
    padded or not, matches eager, and a change of the spans (a parameter, not a constant)
    recompiles nothing."""
    attn = make("adaptive_span", max_span=8, ramp=2).train()
    x, pad = batch([40, 31])

    def loss(x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        return attn(x, pad).square().sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)  # a break raises
    for padding in (pad, None, pad):
        for fn in (loss, compiled):
            attn.zero_grad()
            xi = x.clone().requires_grad_(True)
            fn(xi, padding).backward()
            if fn is loss:
                expected = xi.grad, attn.span_fraction.grad.clone()
        torch.testing.assert_close((xi.grad, attn.span_fraction.grad), expected)
        with torch.no_grad():
            attn.span_fraction.mul_(0.5)  # the spans learn
    assert counters["stats"]["unique_graphs"] == 2  # padded and unpadded, once each


def test_ramp_of_one_is_refused_before_it_traps_a_span():
    """With R = 1 a span of 0 has no key on the ramp (zero gradient: it never grows back), and
    at T > 1024 its reach of 0 divided by zero in the band kernel: refused, naming the fix."""
    with pytest.raises(ConfigError, match=r"ramp >= 2.*never grows back"):
        build("adaptive_span", 32, 4, ramp=1)


@pytest.mark.parametrize("T", [40, 1100])  # all pairs; the band kernel with reach R - 1 = 1
def test_spans_of_zero_run_and_grow_back(T):
    """Every span at 0 (where the L1 penalty pushes them), smallest ramp: the forward pass
    equals the reference and, without the penalty, every span receives a gradient."""
    attn = make("adaptive_span", ramp=2)
    with torch.no_grad():
        attn.span_fraction.zero_()
    x, pad = batch([T, T - 7])
    y = attn(x, pad)
    torch.testing.assert_close(y, attn.dense_reference(x, pad)[0])
    (y - 1).pow(2).sum().backward()
    assert (attn.span_fraction.grad != 0).all()


def test_initial_spans_take_the_true_derivative():
    """Spans start off-integer, so the span gradient at step 1 is the two-sided derivative
    (at an integer span it was the one-sided left one)."""
    attn = make("adaptive_span", max_span=8, ramp=2, init_span=0.5)
    assert attn.spans()[0] != attn.spans()[0].round()
    x, pad = batch([30, 21])
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)

    def loss() -> torch.Tensor:
        return (attn(x, pad) - target).pow(2).sum()

    loss().backward()
    grad, h = attn.span_fraction.grad.clone(), 1e-7
    for i in range(HEADS):
        with torch.no_grad():
            attn.span_fraction[i] += h
            up = loss()
            attn.span_fraction[i] -= 2 * h
            down = loss()
            attn.span_fraction[i] += h
        torch.testing.assert_close(grad[i], (up - down) / (2 * h), rtol=1e-5, atol=1e-9)

"""Kernel choice by measurement (`speechattn.attention.autotune`): a fake timer makes each
kernel win in turn (short / long, sparse's blocked / masked, routing's masked local heads), the
disk cache round-trips and separates its keys, the off switch and the contexts that must keep
the rule do, a kernel that fails while timed is left out, a corrupt cache file is ignored and
rewritten."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from _attention_testing import DIM, HEADS, batch, make
from torch import nn

from speechattn.attention import autotune, available, get
from speechattn.attention.pruning import prune_heads
from speechattn.config import compose

TWO_KERNELS = [n for n in available() if get(n).short_path_max_t is not None]
SLOW = 1000.0  # ms of a kernel the test does not name


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A fresh cache file per test, nothing read into memory yet."""
    monkeypatch.setenv("SPEECHATTN_CACHE", str(tmp_path))
    autotune.clear_memory()
    yield autotune.cache_path()
    autotune.clear_memory()


class FakeTimer:
    """Gives each kernel a set time (ms; 100 or more, so `REPS` steps are enough; `SLOW` for
    kernels not named); records (module's forced kernel, kernel) per step and runs the step,
    so the kernel timed is the one forced."""

    def __init__(self, module: nn.Module, ms: dict[str, float]) -> None:
        self.module, self.ms, self.calls = module, ms, []

    def __call__(self, step, kernel: str, device: torch.device) -> float:
        self.calls.append((self.module._forced_kernel, kernel))
        step()
        return self.ms.get(kernel, SLOW) / 1000


def tuned(name: str, monkeypatch: pytest.MonkeyPatch, ms: dict[str, float], **options):
    attn = make(name, **options)
    timer = FakeTimer(attn, ms)
    monkeypatch.setattr(autotune, "time_once", timer)
    autotune.enable(attn)
    return attn, timer


def x_of(T: int, B: int = 2) -> torch.Tensor:
    return torch.randn(B, T, DIM, dtype=torch.float64)


@pytest.mark.parametrize("name", TWO_KERNELS)
@pytest.mark.parametrize("winner", ["short", "long"])
def test_the_choice_follows_the_timer(name, winner, monkeypatch):
    loser = "long" if winner == "short" else "short"
    attn, timer = tuned(name, monkeypatch, {winner: 100.0, loser: 500.0})
    T = 40  # the rule says short here: a long winner must overrule it
    y = attn(x_of(T))
    assert autotune.use_short_path(attn, x_of(T)) == (winner == "short")
    assert autotune.used(attn, T) == winner + "*"
    assert timer.calls and all(forced == kernel for forced, kernel in timer.calls)
    assert {k for _, k in timer.calls} == set(attn.kernel_names) >= {"short", "long"}
    n = len(timer.calls)
    assert attn(x_of(T)).shape == y.shape
    assert len(timer.calls) == n  # measured once: the second call reads the module's memo
    (choice,) = autotune.choices(attn)["choices"].values()
    assert choice["kernel"] == winner and choice["by"] == "measured"
    others = {k: SLOW for k in attn.kernel_names if k not in (winner, loser)}
    assert choice["ms"] == {winner: 100.0, loser: 500.0, **others}


@pytest.mark.parametrize("winner", ["blocked", "masked"])
@pytest.mark.parametrize("name", ["sparse_strided", "sparse_fixed"])
def test_sparse_runs_the_kernel_the_timer_favours(name, winner, monkeypatch):
    """On CPU sparse_* time their blocked and masked kernels (flex: CUDA only); the run then
    takes the faster one, and its outputs are the reference's either way."""
    from speechattn.attention import sparse

    attn, timer = tuned(name, monkeypatch, {winner: 100.0})
    masked = []
    attend_masked = attn.attend_masked
    monkeypatch.setattr(attn, "attend_masked", lambda *a: masked.append(1) or attend_masked(*a))
    x, pad = batch([40, 27])
    y = attn(x, pad)
    assert {k for _, k in timer.calls} == {"blocked", "masked"}
    assert autotune.used(attn, 40) == winner + "*"
    masked.clear()  # the timing ran both
    attn(x, pad)
    assert bool(masked) == (winner == "masked")
    torch.testing.assert_close(y, attn.dense_reference(x, pad)[0], rtol=1e-10, atol=1e-10)
    assert attn.rule_kernel(40, x.device) == "blocked"  # CPU's rule, which a tie keeps
    assert sparse.AUTO == attn.kernel_names  # flex is timed only when a test names it


def test_routing_may_run_its_local_heads_masked(monkeypatch):
    attn, timer = tuned("routing", monkeypatch, {"masked": 100.0, "long": 200.0})
    T = attn.short_path_max_t + 40  # past the rule's crossover: long, unless measured
    x, pad = batch([T, T - 30])
    y = attn(x, pad)
    assert autotune.used(attn, T) == "masked*"
    torch.testing.assert_close(y, attn.dense_reference(x, pad)[0], rtol=1e-10, atol=1e-10)


def test_a_kernel_option_is_never_timed(monkeypatch):
    attn, timer = tuned("sparse_strided", monkeypatch, {"masked": 100.0}, kernel="blocked")
    assert attn.kernel_names == ("blocked",) and autotune.enable(attn) == 0
    assert autotune.pick_kernel(attn, x_of(40)) == "blocked" and not timer.calls
    assert autotune.used(attn, 40) == "one"


def test_a_kernel_that_fails_while_timed_is_left_out(cache, monkeypatch):
    attn, timer = tuned("sparse_strided", monkeypatch, {"masked": 100.0, "blocked": 200.0})

    def broken(*args):
        raise RuntimeError("no kernel image\nis available")

    monkeypatch.setattr(attn, "attend_masked", broken)
    with pytest.warns(UserWarning, match="the masked kernel failed while timed"):
        assert autotune.pick_kernel(attn, x_of(40)) == "blocked"
    (entry,) = json.loads(cache.read_text())["entries"].values()
    assert entry["failed"] == {"masked": "RuntimeError: no kernel image"}
    assert entry["ms"] == {"blocked": 200.0} and entry["kernel"] == "blocked"


def test_all_pairs_kernels_over_the_budget_are_not_timed(monkeypatch):
    """Over `SCORE_BUDGET` the masked kernel is no candidate: the other candidates (here the
    blocked and, named, the Flex kernel) are still timed, on the caller's batch; with only one
    left the rule decides."""
    attn = make("sparse_strided")
    x = x_of(40, B=6)
    assert autotune.timed_shape(attn, x, 40) == (4, 48, ("blocked", "masked"))
    monkeypatch.setattr(autotune, "SCORE_BUDGET", 1000)
    assert autotune.timed_shape(attn, x, 40) is None
    monkeypatch.setattr(type(attn), "kernel_candidates", lambda self, t: sparse_tuned())
    assert autotune.timed_shape(attn, x, 40) == (4, 48, ("blocked", "flex"))


def sparse_tuned() -> tuple[str, ...]:
    from speechattn.attention import sparse

    return sparse.TUNED


def test_a_short_winner_overrules_the_rule_above_the_crossover(monkeypatch):
    attn, _ = tuned("longformer", monkeypatch, {"short": 100.0, "long": 200.0})
    T = attn.short_path_max_t + 40
    attn(x_of(T, B=1))
    assert autotune.used(attn, T) == "short*"


def test_near_ties_keep_the_rule(monkeypatch):
    attn, _ = tuned("longformer", monkeypatch, {"short": 100.0, "long": 99.0})  # 1 %: noise
    assert autotune.use_short_path(attn, x_of(40))  # the rule's short kernel stays


def test_measuring_leaves_the_run_untouched(monkeypatch):
    """Training mode, parameter gradients and the RNG stream are as before the measurement."""
    attn, timer = tuned("routing", monkeypatch, {"short": 100.0, "long": 200.0})
    attn.train()
    x = x_of(40)
    state = torch.get_rng_state()
    centroids = {k: b.clone() for k, b in attn.named_buffers()}
    assert autotune.use_short_path(attn, x)
    assert timer.calls
    assert attn.training and all(m.training for m in attn.modules())
    assert all(p.grad is None for p in attn.parameters())
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(b, centroids[k]) for k, b in attn.named_buffers())


def test_the_disk_cache_round_trips(cache, monkeypatch):
    attn, timer = tuned("xbox", monkeypatch, {"short": 300.0, "long": 100.0})
    assert not autotune.use_short_path(attn, x_of(40))
    (entry,) = json.loads(cache.read_text())["entries"].values()
    assert entry["kernel"] == "long" and entry["variant"] == "xbox" and entry["bucket"] == 48
    assert entry["heads"] == HEADS and entry["dtype"] == "float64"

    # a new process: nothing in memory, a new module; the file answers, nothing is timed
    autotune.clear_memory()
    again, timer = tuned("xbox", monkeypatch, {"short": 100.0, "long": 300.0})
    assert not autotune.use_short_path(again, x_of(33))  # T = 33 shares bucket 48 with T = 40
    assert not timer.calls
    (choice,) = autotune.choices(again)["choices"].values()
    assert choice["by"] == "cache" and choice["kernel"] == "long"


@pytest.mark.parametrize(
    "change",
    ["length", "batch", "dtype", "options", "variant", "heads", "device"],
)
def test_keys_are_separate(change, cache, monkeypatch):
    """A choice is reused only for the same device, dtype, variant, heads, options, length
    bucket and batch bucket: change any one and it is measured again."""
    attn, _ = tuned("xbox", monkeypatch, {"short": 300.0, "long": 100.0})
    autotune.use_short_path(attn, x_of(40))
    autotune.clear_memory()
    name, options, T, B = "xbox", {}, 40, 2
    if change == "variant":
        name = "simple_lsh"
    elif change == "options":
        options = {"k": 4}
    elif change == "heads":
        options = {}
    elif change == "length":
        T = 60  # bucket 64, not 48
    elif change == "batch":
        B = 4
    other, timer = tuned(name, monkeypatch, {"short": 100.0, "long": 300.0}, **options)
    x = x_of(T, B)
    if change == "dtype":
        other, x = other.float(), x.float()
    elif change == "heads":
        prune_heads(other, [0, 1])
    elif change == "device":
        monkeypatch.setattr(autotune, "_cpu_model", lambda: "Intel Xeon (AMX)")
    assert autotune.use_short_path(other, x)  # measured again, and the fake timer now favours short
    assert timer.calls
    assert len(json.loads(cache.read_text())["entries"]) == 2


def test_the_off_switch_keeps_the_rule(cache, monkeypatch):
    attn = make("longformer")
    timer = FakeTimer(attn, {"short": 500.0, "long": 100.0})
    monkeypatch.setattr(autotune, "time_once", timer)
    assert attn.autotune is False  # a module built in code: the rule
    assert autotune.use_short_path(attn, x_of(40)) and not autotune.use_short_path(attn, x_of(300))
    autotune.enable(attn, False)
    assert autotune.use_short_path(attn, x_of(40))
    assert not timer.calls and not cache.exists()
    assert autotune.choices(attn) == {
        "autotune": False,
        "short_path_max_t": attn.short_path_max_t,
        "choices": {},
    }


def test_pretraining_measures_unless_switched_off():
    assert compose("pretrain", ["attention=xbox"]).attention.autotune is True
    assert (
        compose("pretrain", ["attention=xbox", "attention.autotune=false"]).attention.autotune
        is False
    )


def test_compiling_fake_tensors_and_a_small_budget_keep_the_rule(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    attn, timer = tuned("longformer", monkeypatch, {"short": 500.0, "long": 100.0})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert autotune.use_short_path(attn, x_of(40))
    monkeypatch.undo()

    attn, timer = tuned("longformer", monkeypatch, {"short": 500.0, "long": 100.0})
    with FakeTensorMode():
        assert autotune.use_short_path(attn, torch.empty(2, 40, DIM, dtype=torch.float64))
    monkeypatch.setattr(autotune, "SCORE_BUDGET", 1000)  # not even one sequence's scores fit
    assert autotune.use_short_path(attn, x_of(40))
    assert not timer.calls
    (choice,) = autotune.choices(attn)["choices"].values()
    assert choice == {"bucket": 48, "kernel": "short", "by": "rule (scores over budget)"}


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "entries": {"k": 3}}', "[]"])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(content, cache, monkeypatch):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(content)
    attn, timer = tuned("xbox", monkeypatch, {"short": 300.0, "long": 100.0})
    with pytest.warns(UserWarning, match="kernel cache"):
        assert not autotune.use_short_path(attn, x_of(40))
    assert timer.calls
    data = json.loads(cache.read_text())
    assert data["version"] == autotune.CACHE_VERSION
    ((key, entry),) = data["entries"].items()
    assert entry["kernel"] == "long"
    autotune.clear_memory()  # the rewritten file reads back without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert key in autotune._entries(cache)


def test_metadata_collects_every_layer(monkeypatch):
    """Unshared layers with the same key share one measurement and one entry."""
    layers = nn.ModuleList([make("xbox", layer=j) for j in range(2)])
    timer = FakeTimer(layers[0], {"short": 300.0, "long": 100.0})
    monkeypatch.setattr(autotune, "time_once", timer)
    assert autotune.enable(layers) == 2
    for layer in layers:
        timer.module = layer
        layer(x_of(40))
        layer(x_of(100))
    info = autotune.choices(layers)
    assert info["autotune"] is True and info["short_path_max_t"] == layers[0].short_path_max_t
    assert [c["kernel"] for c in info["choices"].values()] == ["long", "long"]
    assert sorted(c["by"] for c in info["choices"].values()) == ["measured", "measured"]
    assert len(timer.calls) == 2 * 2 * (autotune.REPS + 1)  # two buckets, once each


def test_bucket():
    tops = [autotune.bucket(T) for T in (1, 32, 33, 48, 49, 64, 65, 96, 97, 128, 129, 200)]
    assert tops == [32, 32, 48, 48, 64, 64, 96, 96, 128, 128, 192, 256]
    crossovers = {get(n).short_path_max_t for n in TWO_KERNELS}
    assert all(autotune.bucket(c) == c for c in crossovers)  # the rule and the buckets agree


def test_a_malformed_entry_is_dropped_alone(cache, monkeypatch):
    """Entries are checked field by field: a bad one is measured again, the good ones stay,
    and nothing malformed reaches the choices a model card and upstream.pt record."""
    attn, _ = tuned("xbox", monkeypatch, {"short": 300.0, "long": 100.0})
    autotune.use_short_path(attn, x_of(40))
    ((key, good),) = json.loads(cache.read_text())["entries"].items()
    entries = {
        key: good,
        "bad_ms": {**good, "ms": "zzz"},
        "bad_kernel": {**good, "kernel": 3},
        "negative": {**good, "ms": {"short": -1.0}},
    }
    cache.write_text(json.dumps({"version": autotune.CACHE_VERSION, "entries": entries}))
    autotune.clear_memory()
    with pytest.warns(UserWarning, match=r"ignoring 3 malformed entries .* \(kept 1\)"):
        assert set(autotune._entries(cache)) == {key}

    # a kernel name the variant no longer has is measured again, not run
    autotune.clear_memory()
    cache.write_text(json.dumps({"version": autotune.CACHE_VERSION,
                                 "entries": {key: {**good, "kernel": "gone"}}}))  # fmt: skip
    again, timer = tuned("xbox", monkeypatch, {"short": 300.0, "long": 100.0})
    assert not autotune.use_short_path(again, x_of(40)) and timer.calls
    (choice,) = autotune.choices(again)["choices"].values()
    assert choice["kernel"] == "long" and choice["by"] == "measured"

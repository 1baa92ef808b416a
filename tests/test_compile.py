"""torch.compile of pretraining (`model.compile`, `tasks/pretrain/compiled.py`), every variant.

Per variant a tiny AALBERT (D 32, 4 heads, 1 layer, no dropout) trains two SGD steps through
the compiled masked reconstruction next to an eager copy: the first at T'=24, unpadded, with
the variant's short kernel, the second at T'=40, padded, with its long kernel (two lengths,
so two graphs); losses and updated parameters must match eager. The graph breaks of every
kernel, padded and not, are counted with `torch._dynamo.explain`: none, for every variant.

Backends: `INDUCTOR` (a representative pair: SDPA, and ldsa's custom autograd Function) compile
with inductor, C++ code generation included (30-50 s of CPU each with a cold cache); the
rest with `aot_eager`, the same dynamo capture and AOTAutograd forward+backward trace (graph
breaks, backward tracing, decompositions) without code generation. Inductor's FX graph cache
(on by default, in `/tmp/torchinductor_$USER`) makes reruns fast.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from speechattn.attention import available, get
from speechattn.model.aalbert import AALBERT, ModelConfig, padding_mask_for
from speechattn.model.masking import MaskedBatch, reconstruction_loss
from speechattn.tasks.pretrain.compiled import (
    compile_objective,
    graph_breaks,
    masked_reconstruction,
)

sys.path.insert(0, str(Path(__file__).parent / "attention"))
from _attention_testing import SMALL_OPTIONS, force_path  # noqa: E402

# Every variant's compile unit (1-layer model, T'=24) compiles without a graph break, over
# its kernels (short, and long where it has two), padded or not.
INDUCTOR = ("full", "ldsa")
STEPS = ((24, False, "short"), (40, True, "long"))  # (T', padded, kernel) per step
B, STACKED = 2, 24  # stacked features of 3 frames x 8 bins


def tiny(name: str) -> AALBERT:
    torch.manual_seed(0)
    config = ModelConfig(
        feature_dim=8,
        dim=32,
        num_heads=4,
        ffn_dim=64,
        num_layers=1,
        dropout=0.0,  # compiled dropout draws other random numbers than eager
        attention=name,
        attention_options=SMALL_OPTIONS.get(name, {}),
    )
    return AALBERT(config).train()


def masked_batch(T: int, padded: bool, seed: int) -> MaskedBatch:
    """Random corrupted/clean frames (B, T, 24), chosen frames (B, T), host lengths (B,)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, T - 7 if padded else T])
    valid = torch.arange(T)[None, :] < lengths[:, None]
    chosen = (torch.rand(B, T, generator=g) < 0.3) & valid
    return MaskedBatch(
        inputs=torch.randn(B, T, STACKED, generator=g),
        target=torch.randn(B, T, STACKED, generator=g),
        chosen=chosen,
        lengths=lengths,
        mode=torch.zeros(B, dtype=torch.long),
    )


def sgd_step(model: AALBERT, loss: torch.Tensor, lr: float = 0.1) -> None:
    model.zero_grad(set_to_none=True)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch: dynamo's caches (and its per-function recompile
    limit) are per code object, shared by all tests' compiled functions."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name", available())
def test_no_graph_breaks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No variant breaks its graph, on any kernel, padded or not."""
    model = tiny(name)
    kernels = ("short", "long") if get(name).short_path_max_t is not None else ("short",)
    found = {}
    for kernel in kernels:
        force_path(monkeypatch, kernel)
        for padded in (False, True):
            masked = masked_batch(24, padded, 0)
            pad = padding_mask_for(masked.lengths, masked.inputs)
            info = graph_breaks(model, masked.inputs, masked.target, masked.chosen, pad)
            found[kernel, padded] = info["breaks"]
    assert not any(found.values()), (name, found)


@pytest.mark.slow
@pytest.mark.parametrize("name", available())
def test_compiled_steps_match_eager(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    eager = tiny(name)
    model = copy.deepcopy(eager)
    backend = "inductor" if name in INDUCTOR else "aot_eager"
    loss_of = compile_objective(model, backend=backend)
    graphs = []
    for seed, (T, padded, kernel) in enumerate(STEPS):
        force_path(monkeypatch, kernel)
        masked = masked_batch(T, padded, seed)
        expected = reconstruction_loss(eager, masked)
        graphs_before = counters["stats"]["unique_graphs"]
        loss = loss_of(masked)
        graphs.append(counters["stats"]["unique_graphs"] - graphs_before)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        sgd_step(eager, expected)
        sgd_step(model, loss)
    assert min(graphs) >= 1, f"{name}: a step ran without compiling ({graphs} graphs)"
    for (key, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")


def test_compile_unit_equals_the_objective() -> None:
    """masked_reconstruction with the padding mask decided on the host is the pretraining
    objective (`reconstruction_loss`), padded and not."""
    model = tiny("full")
    for padded in (False, True):
        masked = masked_batch(24, padded, 0)
        pad = padding_mask_for(masked.lengths, masked.inputs)
        assert (pad is None) == (not padded)
        loss = masked_reconstruction(model, masked.inputs, masked.target, masked.chosen, pad)
        torch.testing.assert_close(loss, reconstruction_loss(model, masked))


@pytest.mark.slow
def test_pretrain_task_compiles_training_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """model.compile=true: PretrainTask's training loss goes through the compiled function,
    validation (eval) stays eager, and both equal the uncompiled task's loss."""
    import speechattn.tasks.pretrain.module as module

    calls: list[int] = []

    def compile_counting(model, mode="default"):
        fn = compile_objective(model, mode, backend="aot_eager")

        def counted(masked):
            calls.append(1)
            return fn(masked)

        return counted

    monkeypatch.setattr(module, "compile_objective", compile_counting)
    net = tiny("full").config.to_dict()
    task = module.PretrainTask(model=net, compile=True)
    plain = module.PretrainTask(model=net)
    plain.load_state_dict(task.state_dict())  # same weights; no compiled state in the dict
    batch = {
        "features": torch.randn(B, 72, 8),
        "lengths": torch.tensor([72, 60]),
    }
    for training in (True, False):
        task.train(training)
        plain.train(training)
        got = task.reconstruction_loss(batch, torch.Generator().manual_seed(1))[0]
        want = plain.reconstruction_loss(batch, torch.Generator().manual_seed(1))[0]
        torch.testing.assert_close(got, want)
    assert len(calls) == 1  # the training call


def test_compile_config_options() -> None:
    from speechattn.config import compose

    cfg = compose("pretrain", ["model.compile=true", "model.compile_mode=max-autotune"])
    assert cfg.model.compile is True and cfg.model.compile_mode == "max-autotune"
    with pytest.raises(ValueError, match="compile_mode"):
        compile_objective(tiny("full"), mode="fastest")

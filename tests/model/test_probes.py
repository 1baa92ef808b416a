"""Probe heads on synthetic tensors: shapes, padding, and that they really learn."""

import dataclasses
import inspect

import pytest
import torch

from speechattn.attention import FusedAttentionPool
from speechattn.model.probes import FrameProbe, LayerSelector, MeanPool, UtteranceProbe
from speechattn.tasks.downstream import TaskConfig


def fit(model: torch.nn.Module, inputs: tuple, labels: torch.Tensor, steps: int = 300) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(*inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_layer_selector_single_layer_is_identity() -> None:
    h = torch.randn(2, 1, 5, 3)
    assert torch.equal(LayerSelector(1)(h), h[:, 0])
    with pytest.raises(ValueError, match=r"\(B, 1, T, D\)"):
        LayerSelector(1)(torch.randn(2, 2, 5, 3))


def test_layer_selector_weighted_sum_starts_uniform_and_learns() -> None:
    torch.manual_seed(0)
    sel = LayerSelector(3)
    h = torch.randn(4, 3, 6, 2)
    assert torch.allclose(sel(h), h.mean(dim=1), atol=1e-6)
    # Only layer 2 carries the target: the weights should move towards it.
    target = h[:, 2]
    opt = torch.optim.Adam(sel.parameters(), lr=0.1)
    for _ in range(100):
        loss = (sel(h) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = sel.weights()
    assert w.sum().item() == pytest.approx(1.0)
    assert w.argmax().item() == 2 and w[2] > 0.9


def test_mean_pool_ignores_padding() -> None:
    x = torch.tensor([[[1.0], [3.0], [100.0]], [[2.0], [0.0], [0.0]]])  # (2, 3, 1)
    mask = torch.tensor([[False, False, True], [False, True, True]])
    assert MeanPool()(x, mask).squeeze(-1).tolist() == [2.0, 2.0]
    empty = MeanPool()(x[:1], torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(empty, torch.zeros(1, 1))


@pytest.mark.parametrize("pooling", ["mean", "fused"])
def test_utterance_probe_separates_speakers_despite_padding(pooling: str) -> None:
    torch.manual_seed(0)
    C, D, B, T = 5, 8, 100, 12
    centers = torch.randn(C, D) * 2
    labels = torch.randint(0, C, (B,))
    lengths = torch.randint(3, T + 1, (B,))
    x = centers[labels][:, None, :] + torch.randn(B, T, D)  # (B, T, D)
    mask = torch.arange(T)[None] >= lengths[:, None]
    x = x.masked_fill(mask[..., None], 1e3)  # garbage in padding must not matter
    probe = UtteranceProbe(D, C, pooling=pooling)
    fit(probe, (x, mask), labels, steps=150)
    acc = (probe(x, mask).argmax(-1) == labels).float().mean()
    assert acc > 0.95


def test_unknown_pooling_is_an_error() -> None:
    with pytest.raises(ValueError, match="mean, fused"):
        UtteranceProbe(4, 2, pooling="max")


def test_fused_pooling_scale_has_the_seed_default_everywhere_and_reaches_the_pool() -> None:
    """FusedAttentionPool and TaskConfig (the task group's schema, so every conf/task file)
    default to the seed's sqrt(d)."""
    default = inspect.signature(FusedAttentionPool).parameters["scale"].default
    fields = {f.name: f.default for f in dataclasses.fields(TaskConfig)}
    assert default == "value" == fields["pooling_scale"]
    assert UtteranceProbe(4, 2, "fused").pool.pool.scale == "value"
    assert UtteranceProbe(4, 2, "fused", "key").pool.pool.scale == "key"
    with pytest.raises(ValueError, match="scale must be 'value'"):
        UtteranceProbe(4, 2, "fused", "sqrt")


def test_hidden_layer_mlp_learns_what_a_linear_probe_cannot() -> None:
    """XOR of two feature signs: linearly inseparable, easy for one ReLU layer."""
    torch.manual_seed(0)
    x = torch.randn(1, 1000, 2)  # (B, T, D)
    y = ((x[..., 0] > 0) ^ (x[..., 1] > 0)).long()  # (B, T)
    accs = {}
    for hidden in (0, 1, 2):
        probe = FrameProbe(2, 2, hidden_layers=hidden, hidden_dim=32)
        fit(probe, (x,), y, steps=200)
        accs[hidden] = (probe(x).argmax(-1) == y).float().mean().item()
    assert accs[0] < 0.75
    assert accs[1] > 0.95 and accs[2] > 0.95


def test_frame_probe_shapes_and_depth() -> None:
    probe = FrameProbe(10, 7, hidden_layers=2, hidden_dim=16, dropout=0.1)
    assert probe(torch.randn(3, 4, 10)).shape == (3, 4, 7)
    assert sum(isinstance(m, torch.nn.ReLU) for m in probe.modules()) == 2

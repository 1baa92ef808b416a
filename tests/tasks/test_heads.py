"""Head importance, ablation and pruning (Michel et al. 2019) on tiny models and synthetic data."""

from __future__ import annotations

import pytest
import torch

from speechattn.attention import available
from speechattn.data.features import Normalizer
from speechattn.model import MaskingConfig, aalbert
from speechattn.model.upstream import Upstream
from speechattn.tasks.analysis.heads import (
    HeadsConfig,
    PretrainObjective,
    ProbeObjective,
    PruningConfig,
    ablate,
    analyze_heads,
    evaluate,
    head_gradient,
    head_importance,
    next_heads,
    normalize_per_depth,
    prune_schedule,
    pruning_curve,
)
from speechattn.tasks.downstream import DownstreamProbe, TaskConfig

F = 8  # mel bins of the synthetic features
MASKING = MaskingConfig(fraction=0.3, span=3)


def tiny(attention: str = "full", **kw):
    args = dict(feature_dim=F, dim=16, num_layers=2, num_heads=4, ffn_dim=32, dropout=0.0)
    torch.manual_seed(0)
    return aalbert(**{**args, **kw, "attention": attention}).eval()


def batches(lengths=((40, 25, 33), (30, 12)), seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for ls in lengths:
        n = torch.tensor(ls)
        x = torch.randn(len(ls), int(n.max()), F, generator=g)
        x = x * (torch.arange(x.shape[1])[None] < n[:, None])[..., None]
        out.append({"features": x, "lengths": n, "utt_ids": [f"u{i}" for i in range(len(ls))]})
    return out


def pretrain_objective(attention="full", dtype=torch.float64, data=None, **kw):
    model = tiny(attention, **kw)
    return PretrainObjective(model, data or batches(), MASKING, seed=0, dtype=dtype)


def loss_at(objective, unit, xi) -> float:
    with torch.no_grad():
        return float(objective.loss(unit, xi))


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("attention", ["full", "ldsa", "syn_fixed"])
def test_signed_gradient_matches_central_difference(attention: str) -> None:
    obj = pretrain_objective(attention)
    unit = obj.batches[0]
    xi = obj.ones()
    xi[0, 1] = 0.7  # away from the all-ones point too
    grad = head_gradient(obj, unit, xi)
    eps = 1e-6
    fd = torch.zeros_like(xi)
    for d in range(xi.shape[0]):
        for k in range(xi.shape[1]):
            plus, minus = xi.clone(), xi.clone()
            plus[d, k] += eps
            minus[d, k] -= eps
            fd[d, k] = (loss_at(obj, unit, plus) - loss_at(obj, unit, minus)) / (2 * eps)
    torch.testing.assert_close(grad, fd, rtol=1e-5, atol=1e-8)
    assert grad.abs().min() > 0, "every head should influence the loss"


def test_importance_of_one_example_is_normalised_abs_difference() -> None:
    data = batches(lengths=((37,),))
    obj = pretrain_objective(data=data)
    eps = 1e-6
    fd = torch.zeros(2, 4, dtype=torch.float64)
    unit = obj.batches[0]
    for d in range(2):
        for k in range(4):
            plus, minus = obj.ones(), obj.ones()
            plus[d, k] += eps
            minus[d, k] -= eps
            fd[d, k] = (loss_at(obj, unit, plus) - loss_at(obj, unit, minus)) / (2 * eps)
    for per in ("utterance", "batch"):  # identical for a one-utterance subset
        imp = head_importance(obj, per=per)
        assert imp.units == 1
        torch.testing.assert_close(imp.raw, fd.abs(), rtol=1e-5, atol=1e-9)
        # The finite difference is checked on the raw values above; dividing by a small
        # per-depth norm would magnify its rounding error, so normalisation is checked exactly.
        expected = imp.raw / imp.raw.norm(dim=1, keepdim=True)
        torch.testing.assert_close(imp.normalized, expected, rtol=1e-12, atol=0.0)
        torch.testing.assert_close(imp.normalized.norm(dim=1), torch.ones(2, dtype=torch.float64))


def test_per_utterance_importance_averages_abs_of_each_utterance_alone() -> None:
    """Abs per utterance (Michel et al.), each utterance scored as if in a batch of its own."""
    data = batches()
    obj = pretrain_objective(data=data)
    expected, n = torch.zeros(2, 4, dtype=torch.float64), 0
    for batch in obj.batches:
        for b, length in enumerate(batch.lengths.tolist()):
            if not batch.chosen[b].any():
                continue
            xi = obj.ones().requires_grad_(True)
            hidden = obj.model.embed_and_encode(
                batch.inputs[b : b + 1, :length], batch.lengths[b : b + 1], xi
            )
            pred = obj.model.head(hidden[-1])
            err = (pred - batch.target[b : b + 1, :length]).abs()
            chosen = batch.chosen[b : b + 1, :length, None].double()
            loss = (err * chosen).sum() / (chosen.sum() * err.shape[-1])
            (g,) = torch.autograd.grad(loss, xi)
            expected += g.abs()
            n += 1
    imp = head_importance(obj, per="utterance")
    assert imp.units == n >= 3  # utterances with nothing chosen carry no evidence
    torch.testing.assert_close(imp.raw, expected / n)
    by_batch = head_importance(obj, per="batch")
    assert by_batch.units == 2
    assert not torch.allclose(by_batch.raw, imp.raw), "abs per batch is a different estimator"


def test_normalisation_is_per_depth_and_ignores_masked_heads() -> None:
    raw = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    torch.testing.assert_close(normalize_per_depth(raw), torch.tensor([[0.6, 0.8], [0.0, 0.0]]))
    active = torch.tensor([[True, False], [True, True]])
    torch.testing.assert_close(
        normalize_per_depth(raw, active), torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    )


def test_masks_are_fixed_so_evaluation_is_deterministic() -> None:
    a, b = pretrain_objective(), pretrain_objective()
    for x, y in zip(a.batches, b.batches):
        assert torch.equal(x.chosen, y.chosen) and torch.equal(x.inputs, y.inputs)
    assert evaluate(a) == evaluate(a) == evaluate(b)
    assert sum(int(x.chosen.sum()) for x in a.batches) > 0


# ----------------------------------------------------------------------------- masking


@pytest.mark.parametrize("attention", ["full", "ldsa", "syn_fixed"])
def test_masking_a_head_equals_removing_its_output_projection_columns(attention: str) -> None:
    obj = pretrain_objective(attention, shared=False)
    d, k, dk = 1, 2, 16 // 4
    mask = obj.ones()
    mask[d, k] = 0.0
    masked = evaluate(obj, mask)
    with torch.no_grad():
        obj.model.encoder.layers[d].attention.out_proj.weight[:, k * dk : (k + 1) * dk] = 0.0
    assert evaluate(obj) == pytest.approx(masked, rel=1e-12, abs=1e-14)


def test_masking_a_head_at_every_depth_of_a_shared_layer_equals_removing_it() -> None:
    obj = pretrain_objective(shared=True)
    mask = obj.ones()
    mask[:, 3] = 0.0
    masked = evaluate(obj, mask)
    one_depth = mask.clone()
    one_depth[1, 3] = 1.0  # one xi per depth even with shared weights
    assert evaluate(obj, one_depth) != pytest.approx(masked)
    with torch.no_grad():
        obj.model.encoder.layers[0].attention.out_proj.weight[:, 12:16] = 0.0
    assert evaluate(obj) == pytest.approx(masked, rel=1e-12, abs=1e-14)


def test_metric_is_l1_over_all_chosen_frames() -> None:
    obj = pretrain_objective()
    total = count = 0.0
    with torch.no_grad():
        for b in obj.batches:
            pred = obj.model.head(obj.model.embed_and_encode(b.inputs, b.lengths)[-1])
            w = b.chosen[..., None].double()
            total += float(((pred - b.target).abs() * w).sum())
            count += float(w.sum()) * pred.shape[-1]
    assert evaluate(obj) == pytest.approx(total / count, rel=1e-12)


def test_ablation_matrices() -> None:
    obj = pretrain_objective()
    base = evaluate(obj)
    ab = ablate(obj)
    assert ab.base == base
    mask = obj.ones()
    mask[1, 0] = 0.0
    assert ab.single[1, 0] == pytest.approx(evaluate(obj, mask))
    keep = obj.ones()
    keep[0] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    assert ab.keep_only[0, 2] == pytest.approx(evaluate(obj, keep))
    gone = obj.ones()
    gone[1] = 0.0
    assert ab.layer[1] == pytest.approx(evaluate(obj, gone))
    torch.testing.assert_close(ab.delta("single"), ab.single - base)
    assert ablate(obj, single=False, keep_only=False, layer=False).single is None


# ----------------------------------------------------------------------------- pruning


def test_prune_schedule() -> None:
    assert prune_schedule(16, 0.1) == [0, 2, 3, 5, 6, 8, 10, 11, 13, 14, 16]
    assert prune_schedule(72, 0.1) == [0, 7, 14, 22, 29, 36, 43, 50, 58, 65, 72]
    assert prune_schedule(4, 0.1) == [0, 1, 2, 3, 4]
    assert prune_schedule(16, 0.1, cap=12) == [0, 2, 3, 5, 6, 8, 10, 11, 12]
    assert prune_schedule(8, 0.3) == [0, 2, 5, 7, 8]
    assert prune_schedule(8, 1.0) == [0, 8]


def test_next_heads_lowest_first_with_guard() -> None:
    scores = torch.tensor([[0.1, 0.2], [0.3, 0.05]])
    ones = torch.ones(2, 2)
    assert next_heads(scores, ones, 3) == [(1, 1), (0, 0), (0, 1)]
    assert next_heads(scores, ones, 3, keep_one_per_layer=True) == [(1, 1), (0, 0)]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert next_heads(scores, mask, 1) == [(0, 0)]


def test_pruning_curve_starts_unpruned_and_ends_with_all_heads_masked() -> None:
    obj = pretrain_objective()
    imp = head_importance(obj)
    points = pruning_curve(obj, imp, step=0.1)
    assert points[0].num_masked == 0 and points[0].metric == evaluate(obj)
    assert torch.equal(points[0].mask, obj.ones())
    assert [p.num_masked for p in points] == prune_schedule(8, 0.1)
    assert points[-1].fraction == 1.0 and (points[-1].mask == 0).all()
    assert points[-1].metric == pytest.approx(evaluate(obj, torch.zeros(2, 4)))
    order = [x for p in points for x in p.newly_masked]
    assert order == imp.order(), "heads go in increasing order of normalised importance"
    for a, b in zip(points, points[1:]):  # masks only ever grow
        assert ((b.mask == 0) | (a.mask == 1)).all() and ((a.mask == 0) <= (b.mask == 0)).all()


def test_guarded_pruning_keeps_one_head_per_depth() -> None:
    obj = pretrain_objective()
    points = pruning_curve(obj, head_importance(obj), step=0.1, keep_one_per_layer=True)
    for p in points:
        assert ((p.mask != 0).sum(dim=1) >= 1).all()
    assert points[-1].num_masked == 8 - 2
    assert ((points[-1].mask != 0).sum(dim=1) == 1).all()


def test_recomputed_pruning_reaches_the_end_too() -> None:
    obj = pretrain_objective(dtype=torch.float32)
    imp = head_importance(obj, per="batch")
    points = pruning_curve(obj, imp, step=0.25, recompute=True)
    assert [p.num_masked for p in points] == [0, 2, 4, 6, 8]
    assert points[1].newly_masked == imp.order()[:2], "the first step uses the given importance"


# ----------------------------------------------------------------------------- probe


def probe_setup(level: str = "utterance", hidden_layers: int = 0, layers=(2,)):
    model = tiny()
    upstream = Upstream(model, Normalizer(torch.zeros(F), torch.ones(F)), {}, {}).double().eval()
    target = "speaker"
    name = "speaker_utterance" if level == "utterance" else "speaker_frame"
    task = TaskConfig(name=name, target=target, level=level, hidden_layers=hidden_layers)
    torch.manual_seed(1)
    probe = DownstreamProbe(task, 16, len(layers), 3, 3, 2).double()
    data = batches()
    for i, b in enumerate(data):
        b["speaker"] = torch.arange(len(b["lengths"])) % 3 + i
        b["speaker"] = b["speaker"] % 3
    obj = ProbeObjective(upstream, probe, list(layers), data, target, level, dtype=torch.float64)
    return obj, upstream, probe, data


def test_probe_objective_gradient_and_accuracy() -> None:
    obj, upstream, probe, data = probe_setup(layers=(0, 1, 2))
    unit = obj.split(obj.batches[0])[1]
    xi = obj.ones()
    grad = head_gradient(obj, unit, xi)
    eps = 1e-6
    for d, k in ((0, 0), (1, 3)):
        plus, minus = xi.clone(), xi.clone()
        plus[d, k] += eps
        minus[d, k] -= eps
        fd = (loss_at(obj, unit, plus) - loss_at(obj, unit, minus)) / (2 * eps)
        assert float(grad[d, k]) == pytest.approx(fd, rel=1e-5, abs=1e-9)
    # accuracy of the probe on the upstream's hidden states, computed by hand
    correct = total = 0
    with torch.no_grad():
        for b in data:
            hidden = upstream(b["features"].double(), b["lengths"]).hidden_states
            n = upstream.output_lengths(b["lengths"])
            h = torch.stack([hidden[i] for i in (0, 1, 2)], dim=1)
            pad = torch.arange(h.shape[2])[None] >= n[:, None]
            logits = probe({"hidden": h, "padding_mask": pad, "lengths": n, "utt_ids": []})
            correct += int((logits.argmax(-1) == b["speaker"]).sum())
            total += len(n)
    assert evaluate(obj) == pytest.approx(correct / total)
    assert obj.subset()["scored"] == 5


def test_probe_objective_frame_labels_repeat_the_speaker() -> None:
    obj, *_ = probe_setup(level="frame")
    b = obj.batches[0]
    assert b.labels.shape == (3, 40)
    assert (b.labels[1, 25:] == -100).all() and (b.labels[1, :25] == b.labels[1, 0]).all()
    assert obj.subset()["scored"] == 40 + 25 + 33 + 30 + 12


# ----------------------------------------------------------------------------- variants


@pytest.mark.parametrize("attention", available())
def test_every_variant_gets_importance_ablation_and_a_pruning_curve(attention: str) -> None:
    obj = pretrain_objective(attention, dtype=torch.float32, data=batches(((24, 17),)))
    config = HeadsConfig(pruning=PruningConfig(step=0.5))
    config.ablation.keep_only = False
    a = analyze_heads(obj, config)
    assert a.importance.raw.shape == (2, 4) and torch.isfinite(a.importance.raw).all()
    assert (a.importance.raw > 0).any()
    assert a.ablation.single.shape == (2, 4) and a.ablation.keep_only is None
    assert [p.num_masked for p in a.pruning] == [0, 4, 8]
    assert a.pruning[0].metric == a.base_metric

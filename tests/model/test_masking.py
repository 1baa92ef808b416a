"""Masked acoustic modelling: fraction, spans, 80/10/10 per utterance, padding, short utterances."""

from __future__ import annotations

import pytest
import torch

from speechattn.model.masking import (
    RANDOM,
    UNCHANGED,
    ZERO,
    MaskingConfig,
    draw_spans,
    mask_frames,
    masked_l1,
)


def padded(lengths: list[int], F: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths)
    x = torch.randn(len(lengths), max(max(lengths), 1), F, generator=g) + 5.0  # never 0 by chance
    valid = torch.arange(x.shape[1])[None, :] < lengths_t[:, None]
    return x * valid[..., None], lengths_t


def runs(row: torch.Tensor) -> list[int]:
    """Lengths of the runs of True in a 1-D bool tensor."""
    out, n = [], 0
    for v in row.tolist() + [False]:
        if v:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


def test_fraction_and_spans_over_many_utterances():
    cfg = MaskingConfig()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 400, (400,), generator=g).tolist()
    x, lens = padded(lengths)
    m = mask_frames(x, lens, cfg, g)
    frac = m.chosen.sum().item() / sum(lengths)
    assert abs(frac - 0.15) < 0.01, frac
    for b in range(len(lengths)):
        for r in runs(m.chosen[b]):
            assert r % cfg.span == 0, "chosen frames come in whole spans (touching spans merge)"


def test_modes_are_80_10_10_per_utterance_and_act_on_chosen_frames_only():
    cfg = MaskingConfig()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(40, 120, (4000,), generator=g).tolist()
    x, lens = padded(lengths)
    m = mask_frames(x, lens, cfg, g)
    share = torch.bincount(m.mode, minlength=3).float() / len(lengths)
    # binomial standard deviation at n=4000 is <= 0.0064
    assert abs(share[ZERO] - 0.8) < 0.025 and abs(share[RANDOM] - 0.1) < 0.02
    assert abs(share[UNCHANGED] - 0.1) < 0.02
    untouched = ~m.chosen
    assert torch.equal(m.inputs[untouched], x[untouched])
    for b in range(200):
        chosen = m.chosen[b]
        if m.mode[b] == ZERO:
            assert (m.inputs[b, chosen] == 0).all()
        elif m.mode[b] == UNCHANGED:
            assert torch.equal(m.inputs[b, chosen], x[b, chosen])
        else:  # every replacement is one of the utterance's own valid frames
            n = lengths[b]
            for frame in m.inputs[b, chosen]:
                assert (x[b, :n] == frame).all(-1).any()


def test_padded_frames_are_never_chosen_and_short_utterances_work():
    cfg = MaskingConfig()
    g = torch.Generator().manual_seed(2)
    lengths = [1, 2, 3, 6, 7, 8, 50, 0] * 500
    x, lens = padded(lengths)
    m = mask_frames(x, lens, cfg, g)
    pad = torch.arange(x.shape[1])[None, :] >= lens[:, None]
    assert not (m.chosen & pad).any()
    assert torch.equal(m.inputs[pad], x[pad])
    # expected fraction is kept by stochastic rounding even below one span
    ones = torch.tensor(lengths) == 1
    frac_len1 = m.chosen[ones, 0].float().mean().item()
    assert 0.1 < frac_len1 < 0.2, frac_len1
    assert m.chosen[torch.tensor(lengths) == 0].sum() == 0


def test_loss_is_l1_on_chosen_frames_only_and_zero_when_nothing_is_chosen():
    pred = torch.zeros(2, 5, 3, requires_grad=True)
    target = torch.ones(2, 5, 3)
    target[0, 0] = 7.0  # not chosen: must not count
    chosen = torch.zeros(2, 5, dtype=torch.bool)
    chosen[1, 2:4] = True
    loss = masked_l1(pred, target, chosen)
    assert loss.item() == pytest.approx(1.0)
    empty = masked_l1(pred, target, torch.zeros(2, 5, dtype=torch.bool))
    assert empty.item() == 0.0
    empty.backward()  # still differentiable: a batch of tiny utterances never crashes training
    assert torch.isfinite(pred.grad).all()


def test_masking_is_reproducible_from_the_generator_seed():
    x, lens = padded([30, 12, 5])
    a = mask_frames(x, lens, MaskingConfig(), torch.Generator().manual_seed(5))
    b = mask_frames(x, lens, MaskingConfig(), torch.Generator().manual_seed(5))
    assert torch.equal(a.chosen, b.chosen) and torch.equal(a.inputs, b.inputs)


def test_spans_fit_inside_the_utterance():
    g = torch.Generator().manual_seed(3)
    cfg = MaskingConfig(fraction=0.5, span=4)
    for n in range(0, 40):
        starts = torch.arange(n)[draw_spans(torch.tensor([n]), n, cfg, g)[0][0]]
        s = min(4, n)
        assert all(0 <= int(a) and int(a) + s <= n for a in starts)
        if len(starts) > 1:
            assert (starts.diff() >= s).all(), "spans never overlap"


def test_config_validation():
    with pytest.raises(ValueError, match="fraction"):
        MaskingConfig(fraction=1.5)
    with pytest.raises(ValueError, match="p_zero"):
        MaskingConfig(p_zero=0.9, p_random=0.2)


def test_one_objective_and_one_optimiser_for_pretraining_analysis_and_benchmark():
    """The pretraining step, the head analysis and the benchmark share the model's loss and
    its decay groups (matrices decayed; biases and norms never)."""
    import inspect

    from speechattn.bench import pretrain as bench
    from speechattn.model import aalbert, build_optimizer, corrupt, reconstruction_loss
    from speechattn.model.optim import OptimConfig
    from speechattn.tasks.analysis import heads
    from speechattn.tasks.pretrain import PretrainTask

    for user in (PretrainTask.reconstruction_loss, heads.PretrainObjective, bench.make_step):
        source = inspect.getsource(user)
        assert "reconstruction_loss(" in source and "masked_l1" not in source, user
    model = aalbert(feature_dim=8, dim=16, num_layers=1, num_heads=2, ffn_dim=32).eval()
    x, lens = padded([12, 7], F=8)
    masked = corrupt(model, x, lens, MaskingConfig(span=1, fraction=0.5), torch.Generator())
    assert masked.target.shape == masked.inputs.shape == (2, 4, 24)
    assert masked.lengths.tolist() == [4, 3] and len(masked.utterances()) == 2
    prediction = model.reconstruct(masked.inputs, masked.lengths)
    assert reconstruction_loss(model, masked) == masked_l1(prediction, masked.target, masked.chosen)
    decay, no_decay = build_optimizer(model, OptimConfig()).param_groups
    assert decay["weight_decay"] == 0.01 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])


def test_span_placements_are_uniform_and_batches_pad_to_their_bucket():
    """k spans among n frames: every non-overlapping placement equally likely (n=10, s=3,
    k=2: 15 placements), drawn for all utterances at once; mask_batch pads to the bucket."""
    from collections import Counter

    from speechattn.model.masking import mask_batch

    cfg = MaskingConfig(fraction=0.6, span=3)  # expected spans 0.6 * 10 / 3 = 2 exactly
    starts, _ = draw_spans(torch.full((6000,), 10), 10, cfg, torch.Generator().manual_seed(0))
    placements = Counter(tuple(torch.arange(10)[row].tolist()) for row in starts)
    assert len(placements) == 15 and all(a + 3 <= b for a, b in placements)
    assert all(abs(c - 400) < 80 for c in placements.values()), placements  # sd ~19
    x, lens = padded([30, 12], F=4)
    m = mask_batch(x, lens, 3, MaskingConfig(), torch.Generator().manual_seed(0), 8)
    assert m.inputs.shape == (2, 16, 12) and m.lengths.tolist() == [10, 4]
    assert m.num_chosen == int(m.chosen.sum()) and not m.chosen[:, 10:].any()
    moved = m.to("meta")  # tensors move, lengths stay on the host
    assert moved.inputs.device.type == "meta" and moved.lengths.device.type == "cpu"

"""Log-mel shapes, normalisation, frame stacking and label expansion."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import soundfile as sf
import torch

from speechattn.data import LabelledDataModule
from speechattn.data.features import (
    FeatureConfig,
    LogMel,
    Normalizer,
    cmvn,
    expand_to_labels,
    log_mel_batch,
    num_frames,
    stack_frames,
)


@pytest.mark.parametrize("samples", [400, 401, 559, 560, 16000, 33333])
def test_logmel_frames_follow_snip_edges(samples):
    x = torch.randn(samples) * 0.1
    feats = LogMel()(x)
    assert feats.shape == (num_frames(samples), 80) == ((samples - 400) // 160 + 1, 80)
    assert torch.isfinite(feats).all()


def test_logmel_short_input_and_deltas():
    assert LogMel()(torch.zeros(399)).shape == (0, 80)
    with_deltas = LogMel(FeatureConfig(deltas=True))(torch.randn(8000))
    plain = LogMel()(torch.randn(8000))
    assert with_deltas.shape == (num_frames(8000), 240) and FeatureConfig(deltas=True).dim == 240
    assert plain.shape[0] == with_deltas.shape[0]


def test_feature_config_round_trips():
    cfg = FeatureConfig(n_mels=40, deltas=True)
    assert FeatureConfig(**cfg.to_dict()) == cfg


def test_log_mel_batch_matches_single_utterances(tiny_corpus):
    paths = sorted((tiny_corpus / "synth-clean").glob("*/*/*.flac"))[:3]
    wavs = [torch.from_numpy(sf.read(str(p), dtype="float32")[0]) for p in paths]
    lengths = torch.tensor([len(w) for w in wavs])
    padded = torch.nn.utils.rnn.pad_sequence(wavs, batch_first=True)
    feats, frames = log_mel_batch(padded, lengths)
    for b, w in enumerate(wavs):
        single = LogMel()(w)
        assert frames[b] == single.shape[0]
        torch.testing.assert_close(feats[b, : frames[b]], single)
        assert (feats[b, frames[b] :] == 0).all()


def test_normalizer_global_and_padding():
    x = torch.randn(2, 5, 3) * 4 + 2
    norm = Normalizer(torch.full((3,), 2.0), torch.full((3,), 4.0))
    out = norm(x, torch.tensor([5, 3]))
    torch.testing.assert_close(out[0], (x[0] - 2) / 4)
    assert (out[1, 3:] == 0).all()
    restored = Normalizer.from_state_dict(norm.state_dict())
    torch.testing.assert_close(restored.mean, norm.mean)
    torch.testing.assert_close(restored.std, norm.std)
    with pytest.raises(ValueError, match="dims"):
        norm(torch.zeros(4, 7))


def test_normalizer_from_sums():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(1000, 4))
    norm = Normalizer.from_sums(1000, x.sum(0), (x**2).sum(0))
    np.testing.assert_allclose(norm.mean.numpy(), x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(norm.std.numpy(), x.std(0), rtol=1e-4)


def test_cmvn_per_utterance_ignores_padding():
    x = torch.randn(2, 6, 3) * 3 + 5
    lengths = torch.tensor([6, 4])
    out = Normalizer(torch.zeros(3), torch.ones(3), mode="utterance")(x, lengths)
    torch.testing.assert_close(out[1, :4], cmvn(x[1, :4]), atol=1e-4, rtol=1e-4)
    assert out[1, :4].mean(0).abs().max() < 1e-5 and (out[1, 4:] == 0).all()


def test_training_split_is_normalised(tiny_data_config):
    dm = LabelledDataModule(tiny_data_config)
    dm.setup("fit")
    frames = torch.cat(
        [b["features"][~b["padding_mask"]] for b in dm.extraction_dataloader("train")]
    )
    assert frames.shape[1] == dm.feature_dim == 80
    assert frames.mean(0).abs().max() < 1e-3  # per dimension
    assert (frames.std(0) - 1).abs().max() < 1e-2
    test = torch.cat([b["features"][~b["padding_mask"]] for b in dm.test_dataloader()])
    assert test.mean().abs() < 0.5 and 0.5 < test.std() < 1.5  # same statistics applied


def test_utterance_cmvn_option(tiny_data_config):
    dm = LabelledDataModule(dataclasses.replace(tiny_data_config, normalization="utterance"))
    dm.setup("fit")
    batch = next(iter(dm.test_dataloader()))
    for b in range(len(batch["utt_ids"])):
        x = batch["features"][b, : batch["lengths"][b]]
        assert x.mean(0).abs().max() < 1e-3


def test_stack_frames_shapes_and_content():
    x = torch.arange(2 * 7 * 2, dtype=torch.float32).reshape(2, 7, 2)
    stacked, lengths = stack_frames(x, torch.tensor([7, 4]), factor=3)
    assert stacked.shape == (2, 3, 6) and lengths.tolist() == [3, 2]
    torch.testing.assert_close(stacked[0, 0], x[0, :3].reshape(-1))
    torch.testing.assert_close(stacked[0, 2, :2], x[0, 6])
    assert (stacked[0, 2, 2:] == 0).all()  # partial last model frame is zero-filled
    assert (stacked[1, 1, 2:] == 0).all() and (stacked[1, 2] == 0).all()  # padding stays zero


def test_stack_frames_pads_to_a_bucket_in_the_same_call_and_leaves_its_input_alone():
    x = torch.randn(2, 7, 2) + 5.0  # nonzero everywhere, padding included
    before = x.clone()
    plain, _ = stack_frames(x, torch.tensor([7, 4]), factor=3)
    bucket, lengths = stack_frames(x, torch.tensor([7, 4]), factor=3, frames=5)
    assert bucket.shape == (2, 5, 6) and lengths.tolist() == [3, 2]
    torch.testing.assert_close(bucket[:, :3], plain)
    assert (bucket[:, 3:] == 0).all() and (plain[1, 1, 2:] == 0).all()
    torch.testing.assert_close(x, before)  # zeroed in its own copy
    same, _ = stack_frames(x[:, :6], torch.tensor([6, 4]), factor=3)  # no pad: still a copy
    torch.testing.assert_close(x, before)
    assert (same[1, 1, 2:] == 0).all()


def test_stack_then_expand_round_trip():
    T, F = 10, 2
    x = torch.randn(1, T, F)
    stacked, lengths = stack_frames(x, torch.tensor([T]))  # (1, 4, 6)
    back = expand_to_labels(
        stacked, 3, torch.tensor([T]), ["u"], tolerance=0, lengths=lengths
    )  # (1, 10, 6)
    assert back.shape == (1, T, 3 * F)
    for t in range(T):  # label frame t sees the model frame that contains 10 ms frame t
        torch.testing.assert_close(back[0, t].reshape(3, F)[t % 3], x[0, t])


def test_expand_to_labels_trims_pads_and_zeros_past_labels():
    h = torch.arange(1, 5, dtype=torch.float32).reshape(1, 4, 1).repeat(2, 1, 1)  # (2, 4, 1)
    out = expand_to_labels(
        h, 3, torch.tensor([13, 8]), ["a", "b"], tolerance=2, lengths=torch.tensor([4, 3])
    )
    assert out.shape == (2, 13, 1)
    assert out[0, :, 0].tolist() == [
        1,
        1,
        1,
        2,
        2,
        2,
        3,
        3,
        3,
        4,
        4,
        4,
        4,
    ]  # padded with the last frame
    assert out[1, :, 0].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 0, 0, 0, 0, 0]  # trimmed, then zeros


def test_expand_to_labels_tolerance_error_names_the_utterance():
    h = torch.zeros(2, 4, 1)
    lengths = torch.tensor([4, 4])
    expand_to_labels(h, 3, torch.tensor([12, 14]), ["ok", "edge"], tolerance=2, lengths=lengths)
    with pytest.raises(ValueError, match=r"utterance 19-198-0003: 15 labels .* 12 frames"):
        expand_to_labels(
            h, 3, torch.tensor([12, 15]), ["x", "19-198-0003"], tolerance=2, lengths=lengths
        )
    with pytest.raises(ValueError, match="too-short"):
        expand_to_labels(
            h, 3, torch.tensor([12, 7]), ["x", "too-short"], tolerance=2, lengths=lengths
        )
    # without model lengths only the "labels outrun the frames" direction can be checked
    expand_to_labels(h, 3, torch.tensor([12, 7]), ["x", "y"], tolerance=2)

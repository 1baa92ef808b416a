"""The s3prl expert on a freshly pretrained upstream, against the real `s3prl` package.

s3prl 0.4.18 (the `s3prl` extra) is tested through `s3prl.upstream.interfaces`: `UpstreamBase`
(hooks) and `Featurizer`, the weighted layer sum that `run_downstream.py` puts on an upstream.
Every feature is compared with `load_upstream` on the same audio.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

import speechattn
from speechattn.interop.s3prl import (
    S3PRL_AVAILABLE,
    UpstreamExpert,
    WaveformError,
    speechattn_local,
)

interfaces = pytest.importorskip("s3prl.upstream.interfaces")

LENGTHS = (16000, 11_523, 4_800, 400)  # samples: 1 s, odd length, 0.3 s, one window


def waveforms(lengths=LENGTHS, seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [0.1 * torch.randn(n, generator=g) for n in lengths]


def reference(path: Path, wavs: list[Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
    """`load_upstream`'s hidden states on the same audio, zero-padded as a batch."""
    up = speechattn.load_upstream(path)
    lengths = torch.tensor([w.numel() for w in wavs])
    padded = torch.nn.utils.rnn.pad_sequence(wavs, batch_first=True)
    with torch.no_grad():
        features, frames = up.features_from_waveforms(padded, lengths)
        return up(features, frames).hidden_states, up.output_lengths(frames)


@pytest.fixture(scope="module")
def upstream_pt(pretrained_tiny_run: Path) -> Path:
    return pretrained_tiny_run / "upstream.pt"


@pytest.fixture(scope="module")
def expert(upstream_pt: Path) -> UpstreamExpert:
    return speechattn_local(str(upstream_pt)).eval()


def test_expert_is_an_s3prl_upstream(expert):
    assert S3PRL_AVAILABLE
    assert isinstance(expert, interfaces.UpstreamBase)
    assert expert.get_downsample_rates("hidden_states") == 480
    assert expert.get_downsample_rates("last_hidden_state") == 480
    assert expert.upstream.samples_per_frame == 480  # derived from the file: 160-sample hop x 3


def test_forward_gives_load_upstreams_hidden_states(expert, upstream_pt):
    wavs = waveforms()
    with torch.no_grad():
        out = expert(wavs)
    ref, out_lengths = reference(upstream_pt, wavs)
    hidden = out["hidden_states"]
    assert len(hidden) == 1 + 2  # input embedding + 2 layers
    # 1 s -> 98 mel frames -> 33 model frames; 400 samples -> 1 frame
    assert out_lengths.tolist() == [33, 24, 10, 1]
    for got, want in zip(hidden, ref, strict=True):
        assert got.shape == (4, 33, 32)
        assert torch.equal(got, want)
    assert torch.equal(out["last_hidden_state"], ref[-1])
    for b, n in enumerate(out_lengths.tolist()):  # padding is zero in every layer
        assert all((h[b, n:] == 0).all() for h in hidden)
    # in a batch or alone, an utterance gets the same features (to SDPA rounding)
    with torch.no_grad():
        alone = expert([wavs[1]])["hidden_states"]
    for a, h in zip(alone, hidden):
        torch.testing.assert_close(a[0], h[1, :24], rtol=1e-4, atol=1e-5)


def test_featurizer_weighted_sum_has_s3prls_shape_and_lengths(expert, upstream_pt):
    featurizer = interfaces.Featurizer(expert, upstream_device="cpu")
    assert featurizer.layer_num == 3 and featurizer.output_dim == 32
    assert featurizer.downsample_rate == 480
    wavs = waveforms()
    with torch.no_grad():
        features = featurizer(wavs, expert(wavs))
    ref, _ = reference(upstream_pt, wavs)
    # untrained layer weights: softmax(0) = the mean of the L+1 hidden states
    mixed = torch.stack(ref).mean(0)
    assert [f.shape for f in features] == [(round(len(w) / 480), 32) for w in wavs]
    assert [f.shape[0] for f in features] == [33, 24, 10, 1]
    for b, f in enumerate(features):
        torch.testing.assert_close(f, mixed[b, : f.shape[0]], rtol=1e-6, atol=1e-6)
    # a trained mix and a single layer (-l) select what load_upstream gives
    with torch.no_grad():
        featurizer.weights.copy_(torch.tensor([0.0, -1.0, 2.0]))
        features = featurizer(wavs, expert(wavs))
    w = torch.softmax(torch.tensor([0.0, -1.0, 2.0]), 0)
    mixed = sum(w[k] * ref[k] for k in range(3))
    torch.testing.assert_close(features[0], mixed[0, :33], rtol=1e-5, atol=1e-6)
    last = interfaces.Featurizer(expert, upstream_device="cpu", layer_selection=2)
    with torch.no_grad():
        features = last(wavs, expert(wavs))
    assert torch.equal(features[2], ref[2][2, :10])


def test_s3prl_hooks_replace_the_returned_states(upstream_pt):
    # s3prl's own experts collect hidden states with forward hooks; ours accept them too
    hooks = [
        ("self.upstream.model.embedding", lambda inp, out: out),
        ("self.upstream.model.encoder.layers[0]", lambda inp, out: out),  # shared: runs L times
    ]
    expert = UpstreamExpert(upstream_pt, hooks=hooks).eval()
    wav = waveforms((8000,))
    with torch.no_grad():
        out = expert(wav)
    ref, _ = reference(upstream_pt, wav)
    assert out["_hidden_states_info"] == (
        "self.upstream.model.embedding",
        *["self.upstream.model.encoder.layers[0]"] * 2,
    )
    hidden = out["hidden_states"]
    assert len(hidden) == 3 and torch.equal(hidden[0], ref[0]) and torch.equal(hidden[1], ref[1])
    assert torch.equal(out["last_hidden_state"], hidden[-1])


def test_bad_input_is_named(expert, tmp_path):
    with pytest.raises(ValueError, match=r"wavs\[1\]: expected a 1-D 16000 Hz waveform"):
        expert([torch.zeros(800), torch.zeros(2, 800)])
    with pytest.raises(ValueError, match=r"wavs\[0\]: 399 samples is shorter"):
        expert([torch.zeros(399)])
    with pytest.raises(ValueError, match=r"wavs\[0\]: expected a float waveform.*int64"):
        expert([torch.zeros(800, dtype=torch.long)])
    with pytest.raises(ValueError, match="non-empty list"):
        expert(torch.zeros(2, 800))
    with pytest.raises(ValueError, match="non-empty list"):
        expert([])
    with pytest.raises(ValueError, match="resample to 16000 Hz"):
        expert([torch.zeros(800)], sample_rate=8000)
    with pytest.raises(ValueError, match="needs ckpt=PATH"):
        UpstreamExpert()
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        UpstreamExpert(tmp_path / "missing.pt")
    (tmp_path / "bad.pt").write_text("not a model")
    with pytest.raises(speechattn.model.UpstreamFileError, match="bad.pt"):
        UpstreamExpert(tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="drop -g"):
        UpstreamExpert(tmp_path / "bad.pt", model_config="config.yaml")


# every sample count from one window to 2 s in steps that hit all residues mod 160 and 480,
# plus the lengths where the model gives one frame fewer than s3prl assumes (9000: 18 vs 19)
SWEEP = sorted({*range(400, 32_000, 163), 9000, 9_120, 9_600, 10_080, 401, 479, 480, 719, 720})


def test_lengths_agree_with_s3prls_featurizer_for_every_input_length(expert, upstream_pt):
    featurizer = interfaces.Featurizer(expert, upstream_device="cpu")
    up = speechattn.load_upstream(upstream_pt)
    fewer = 0
    for start in range(0, len(SWEEP), 16):
        lengths = SWEEP[start : start + 16]
        wavs = waveforms(lengths, seed=start)
        with torch.no_grad():
            out = expert(wavs)
            features = featurizer(wavs, out)
        ref, model_frames = reference(upstream_pt, wavs)
        mixed = torch.stack(ref).mean(0)  # untrained Featurizer weights: the layer mean
        assert out["hidden_states"][0].shape[1] == max(round(n / 480) for n in lengths)
        for b, (n, f) in enumerate(zip(lengths, features, strict=True)):
            want, got = round(n / 480), int(model_frames[b])
            assert f.shape == (want, up.hidden_dim), n
            k = min(want, got)
            torch.testing.assert_close(f[:k], mixed[b, :k], rtol=1e-5, atol=1e-6)
            if want > got:  # the rule: the last model frame repeats, never a zero frame
                fewer += 1
                assert torch.equal(f[got:], f[got - 1 : got].expand(want - got, -1)), n
            for h in out["hidden_states"]:  # zero past s3prl's count
                assert (h[b, want:] == 0).all()
    assert fewer > 0  # the sweep does reach the lengths the rule exists for


def test_nonfinite_or_int16_range_waveforms_are_refused(expert):
    wav = 0.1 * torch.randn(8000, generator=torch.Generator().manual_seed(3))
    for bad, message in (
        (
            torch.where(torch.arange(8000) == 77, float("nan"), wav),
            "the waveform holds NaN or infinite",
        ),
        (torch.where(torch.arange(8000) == 5, float("inf"), wav), "the waveform holds NaN or inf"),
        (wav * 1e30, r"peak amplitude 4\.149e\+29 is far outside"),
        (wav * 32768, r"peak amplitude 1\.359e\+04 .* divided by 32768"),
    ):
        with pytest.raises(WaveformError, match=r"wavs\[1\]: " + message):
            expert([wav, bad])
    with pytest.raises(speechattn.errors.SpeechattnError):
        expert([wav * 1e30])
    # s3prl's Featurizer probes with unit-variance noise: that must pass
    with torch.no_grad():
        assert torch.isfinite(expert([torch.randn(16000)])["hidden_states"][-1]).all()


def test_expert_starts_in_eval_mode(upstream_pt):
    expert = UpstreamExpert(upstream_pt)
    assert not expert.training and not any(m.training for m in expert.modules())


def test_an_upstream_folder_gives_the_same_expert(expert, upstream_pt):
    # the run's safetensors folder (upstream/), beside its upstream.pt
    folder = UpstreamExpert(upstream_pt.parent / "upstream")
    assert isinstance(folder, interfaces.UpstreamBase)
    wavs = waveforms()
    with torch.no_grad():
        got, want = folder(wavs)["hidden_states"], expert(wavs)["hidden_states"]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)

"""upstream.pt: save -> load_upstream round trip, the upstream contract, and bad files."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import speechattn
from speechattn.data.features import FeatureConfig, Normalizer
from speechattn.model import UpstreamFileError, UpstreamOutput, aalbert, load_upstream
from speechattn.model.upstream import save_upstream, upstream_state


@pytest.fixture
def saved(tmp_path):
    model = aalbert(feature_dim=8, dim=32, num_layers=2, num_heads=4, ffn_dim=64, attention="ldsa")
    mean, std = torch.randn(8), torch.rand(8) + 0.5
    meta = {"steps": 12, "corpus": "embedded", "seed": 3, "code_version": speechattn.code_version()}
    state = upstream_state(model, Normalizer(mean, std), FeatureConfig(n_mels=8).to_dict(), meta)
    path = save_upstream(tmp_path / "upstream.pt", state)
    return model.eval(), path, mean, std


def test_round_trip_gives_identical_hidden_states(saved):
    model, path, mean, std = saved
    up = speechattn.load_upstream(path)
    x = torch.randn(2, 20, 8)
    lengths = torch.tensor([20, 7])
    with torch.no_grad():
        ref, got = model(x, lengths), up(x, lengths).hidden_states
    assert len(got) == 3
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert up.output_lengths(lengths).tolist() == [7, 3]
    assert (up.downsample, up.hidden_dim, up.num_layers, up.num_heads) == (3, 32, 2, 4)
    assert up.frame_rate == pytest.approx(100 / 3)
    assert up.attention_name == "ldsa" and up.feature_dim == 8
    assert up.metadata["steps"] == 12 and up.metadata["corpus"] == "embedded"
    assert not up.training
    torch.testing.assert_close(up.mean, mean)
    raw = torch.randn(1, 5, 8)
    torch.testing.assert_close(up.normalize(raw), (raw - mean) / std)
    w = up.attention_weights(x, lengths, layer=1)
    assert w.shape == (2, 4, 7, 7)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.pt"):
        load_upstream(tmp_path / "nothere.pt")


@pytest.mark.parametrize("kind", ["garbage", "text", "truncated", "foreign", "checkpoint_like"])
def test_bad_files_raise_an_error_naming_the_file(saved, tmp_path, kind):
    _, good, _, _ = saved
    bad = tmp_path / f"bad_{kind}.pt"
    if kind == "garbage":
        bad.write_bytes(bytes(range(256)) * 10)
    elif kind == "text":
        bad.write_text("hello")
    elif kind == "truncated":
        bad.write_bytes(good.read_bytes()[:2000])
    elif kind == "foreign":
        torch.save({"weights": torch.zeros(3)}, bad)
    else:  # a pickled object, as in Lightning checkpoints: refused by weights_only loading
        torch.save({"obj": torch.nn.Linear(2, 2)}, bad)
    with pytest.raises(UpstreamFileError, match=f"bad_{kind}.pt"):
        load_upstream(bad)


def test_wrong_version_and_incomplete(saved, tmp_path):
    _, good, _, _ = saved
    state = torch.load(good, weights_only=True)
    state["version"] = 99
    torch.save(state, tmp_path / "v99.pt")
    with pytest.raises(UpstreamFileError, match="version"):
        load_upstream(tmp_path / "v99.pt")
    state["version"] = 1
    del state["normalizer"]
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(UpstreamFileError, match="normalizer"):
        load_upstream(tmp_path / "partial.pt")


def test_features_from_waveforms_match_the_data_layer(saved):
    _, path, mean, std = saved
    from speechattn.data.features import log_mel_batch

    up = load_upstream(path)
    t = torch.arange(8000) / 16000
    wavs = torch.stack([torch.sin(2 * torch.pi * 440 * t), 0.1 * torch.randn(8000)])
    wavs[1, 5000:] = 0
    lengths = torch.tensor([8000, 5000])
    feats, frames = up.features_from_waveforms(wavs, lengths)
    raw, raw_frames = log_mel_batch(wavs, lengths, FeatureConfig(n_mels=8))
    assert frames.tolist() == raw_frames.tolist() == [48, 29]
    torch.testing.assert_close(feats[0], (raw[0] - mean) / std)
    assert (feats[1, 29:] == 0).all()
    assert len(up(feats, frames).hidden_states) == 3


def plain_and_with_weights(saved):
    """The loaded upstream, its inputs, and its plain call and `output_attentions=True` call."""
    up = load_upstream(saved[1])
    x, lengths = torch.randn(2, 20, 8), torch.tensor([20, 7])
    with torch.no_grad():
        return up, x, lengths, up(x, lengths), up(x, lengths, output_attentions=True)


def test_output_is_hf_style_with_every_layer(saved):
    model, path, _, _ = saved
    up = load_upstream(path)
    x, lengths = torch.randn(2, 20, 8), torch.tensor([20, 7])
    with torch.no_grad():
        ref, out = model(x, lengths), up(x, lengths)
    assert isinstance(out, UpstreamOutput)
    assert out.keys() == [
        "last_hidden_state",
        "extract_features",
        "hidden_states",
        "output_lengths",
    ]
    assert out.attentions is None
    assert isinstance(out.hidden_states, tuple) and len(out.hidden_states) == 3
    for a, b in zip(ref, out.hidden_states, strict=True):
        assert a.shape[:2] == (2, 7) and torch.equal(a, b)
    assert out.last_hidden_state is out.hidden_states[-1]
    assert out["last_hidden_state"] is out.last_hidden_state
    assert out.output_lengths.tolist() == [7, 3]
    stacked, _ = up.model.stack(x, lengths)
    assert out.extract_features.shape == (2, 7, 24)
    assert torch.equal(out.extract_features, stacked)
    assert len(out.to_tuple()) == 4 and out.to_tuple()[0] is out.last_hidden_state
    with pytest.raises(KeyError, match="attentions"):
        out["attentions"]  # not requested: absent, as in HF's ModelOutput
    with pytest.raises(KeyError, match=r"out\.hidden_states\[-1\]"):
        out[-1]  # a layer is out.hidden_states[i], and the message says so
    with pytest.raises(TypeError, match="return_dict"):
        up(x, lengths, return_dict=True)  # one return type: there is no flag to choose it


def test_output_attentions_are_each_layers_weights(saved):
    up, x, lengths, plain, out = plain_and_with_weights(saved)
    with torch.no_grad():
        per_layer = [up.attention_weights(x, lengths, layer=k) for k in (1, 2)]
    assert len(out.attentions) == 2 and out.keys()[-2:] == ["attentions", "output_lengths"]
    for k, w in enumerate(out.attentions):
        assert w.shape == (2, 4, 7, 7)
        torch.testing.assert_close(w, per_layer[k])
        torch.testing.assert_close(w[0].sum(-1), torch.ones(4, 7))  # rows are distributions
        assert (w[1, :, 3:] == 0).all() and (w[1, :, :3, 3:] == 0).all()  # padding gets none
    # dense reference path: equal to rounding
    for a, b in zip(plain.hidden_states, out.hidden_states, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.extract_features, plain.extract_features)
    assert torch.equal(out.output_lengths, plain.output_lengths)


def test_output_attentions_for_a_variant_without_weights_says_so(saved, monkeypatch):
    _, path, _, _ = saved
    up = load_upstream(path)
    attention = up.model.encoder.layers[0].attention
    monkeypatch.setattr(type(attention), "supports_weights", False)
    with pytest.raises(ValueError, match="'ldsa' cannot return attention weights"):
        up(torch.randn(1, 9, 8), torch.tensor([9]), output_attentions=True)
    out = up(torch.randn(1, 9, 8), torch.tensor([9]))
    assert len(out.hidden_states) == 3 and out.attentions is None


def test_samples_per_frame_comes_from_the_feature_hop_and_stacking(saved):
    _, path, _, _ = saved
    up = load_upstream(path)
    assert up.samples_per_frame == 160 * 3 == 480


@pytest.mark.parametrize("name", ["upstream.pt", "last.ckpt"])
def test_a_crafted_pickle_is_refused_and_never_runs(saved, tmp_path, crafted_torch_file, name):
    _, good, _, _ = saved
    crafted = tmp_path / name
    marker = crafted_torch_file(crafted, torch.load(good, weights_only=True))
    with pytest.raises(UpstreamFileError, match="refused to unpickle") as info:
        load_upstream(crafted)
    assert not marker.exists()
    message = str(info.value)
    assert str(crafted) in message and "weights_only=False" not in message
    if name.endswith(".ckpt"):  # the suggested export is itself a safe load
        assert "export_upstream" in message


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_files_keep_the_attention_definition_they_were_trained_with(tmp_path, version):
    """An LSH upstream written before its definition changed (options unstated) loads with
    the definition of its format version, not today's defaults: version 1 with the first
    runs' raw-vector scores and position tie-break, versions 1 and 2 with sign codes of the
    raw shared vectors; a version 3 file gets today's (XBOX: l2 codes of the scored keys)."""
    model = aalbert(feature_dim=8, dim=32, num_layers=1, num_heads=4, ffn_dim=64, attention="xbox")
    meta = {"steps": 1, "corpus": "embedded", "seed": 0, "code_version": speechattn.code_version()}
    state = upstream_state(model, Normalizer(torch.zeros(8), torch.ones(8)), {"n_mels": 8}, meta)
    state = {**state, "version": version}
    if version < 3:  # sign codes: no bucket offsets then
        state["state_dict"] = {k: v for k, v in state["state_dict"].items() if "offsets" not in k}
    up = load_upstream(save_upstream(tmp_path / "upstream.pt", state))
    attn = up.model.encoder.layers[0].attention
    want = {
        1: (False, "position", "sign", "shared"),
        2: (True, "score", "sign", "shared"),
        3: (True, "score", "l2", "scored"),
    }[version]
    assert (attn.normalize_keys, attn.tie_break, attn.hash, attn.hash_keys) == want


def test_earlier_options_name_registered_variants_and_their_options():
    """The table of changed defaults (`EARLIER_OPTIONS`) names variants by registry name: each
    one exists and has the options it sets, and a change of LSH's definition lists every LSH
    variant."""
    from speechattn.attention import available, get
    from speechattn.attention.lsh import _LSHAttention
    from speechattn.model.upstream import EARLIER_OPTIONS, UPSTREAM_VERSION

    lsh = {n for n in available() if issubclass(get(n), _LSHAttention)}
    for version, by_variant in EARLIER_OPTIONS.items():
        assert 1 < version <= UPSTREAM_VERSION
        if lsh & set(by_variant):
            assert lsh <= set(by_variant), f"version {version}: {sorted(lsh - set(by_variant))}"
        for name, values in by_variant.items():
            fields = {f.name for f in dataclasses.fields(get(name).Config)}
            assert set(values) <= fields, f"{name}: {sorted(set(values) - fields)}"


def test_features_from_waveforms_takes_a_list_as_s3prl_passes_it(saved):
    _, path, _, _ = saved
    from speechattn.model.upstream import WaveformError

    up = load_upstream(path)
    wavs = [0.1 * torch.randn(8000), 0.1 * torch.randn(5000)]
    padded = torch.stack([wavs[0], torch.cat([wavs[1], torch.zeros(3000)])])
    feats, frames = up.features_from_waveforms(wavs)
    ref, ref_frames = up.features_from_waveforms(padded, torch.tensor([8000, 5000]))
    assert torch.equal(frames, ref_frames) and torch.equal(feats, ref)
    with pytest.raises(WaveformError, match="needs its sample counts"):
        up.features_from_waveforms(padded)
    with pytest.raises(WaveformError, match=r"wavs\[1\]: .*NaN"):
        up.features_from_waveforms([wavs[0], torch.full((5000,), float("nan"))])

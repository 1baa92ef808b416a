"""An upstream handed to downstream evaluation is checked before it is used: implausible
weights or features are refused, the upstream's own normalisation is used unless told
otherwise (and the choice is logged and recorded), and a wrong `upstream=` or feature setting is
reported in words before any feature is extracted."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from speechattn.config import compose
from speechattn.data import LabelledDataModule, Normalizer
from speechattn.errors import ConfigError, MissingFileError
from speechattn.model.upstream import (
    WEIGHT_LIMIT,
    ImplausibleWeightsError,
    UpstreamFileError,
    save_upstream,
    upstream_state,
)
from speechattn.tasks.downstream import run
from speechattn.tasks.downstream.features import (
    FEATURE_LIMIT,
    ImplausibleFeaturesError,
    MelUpstream,
    extract_split,
    feature_normalization,
    open_upstream,
)


def save_tiny_upstream(
    path: Path, n_mels: int = 8, deltas: bool = False, mean: float = 0.0, std: float = 1.0
) -> Path:
    from speechattn.model.aalbert import aalbert

    dim = n_mels * (3 if deltas else 1)
    torch.manual_seed(0)
    model = aalbert(feature_dim=dim, dim=16, num_layers=2, num_heads=2, ffn_dim=32)
    normalizer = Normalizer(torch.full((dim,), mean), torch.full((dim,), std))
    features = {"n_mels": n_mels, "deltas": deltas}
    return save_upstream(path, upstream_state(model, normalizer, features, {"steps": 1}))


def batch_of(features: torch.Tensor, lengths: list[int]) -> dict:
    n = torch.tensor(lengths)
    T = features.size(1)
    return {
        "features": features,
        "lengths": n,
        "padding_mask": torch.arange(T)[None] >= n[:, None],
        "utt_ids": [f"u{i}" for i in range(len(lengths))],
    }


# ----------------------------------------------------------------------------- scale (13)


def test_an_upstream_with_huge_finite_weights_is_refused(tmp_path: Path) -> None:
    """One AdamW step at lr=1e5 leaves finite weights of about 1e5: refused on loading (it
    was loaded, and probed at chance, before) and never written."""
    path = save_tiny_upstream(tmp_path / "upstream.pt")
    state = torch.load(path, weights_only=True)
    state["state_dict"]["embedding.proj.weight"] *= 1e6  # finite, |w| about 1e5
    torch.save(state, path)
    with pytest.raises(ImplausibleWeightsError, match="embedding.proj.weight") as info:
        open_upstream(path, 8)
    assert str(path) in str(info.value) and f"beyond {WEIGHT_LIMIT:g}" in str(info.value)
    with pytest.raises(ImplausibleWeightsError, match="not writing"):
        save_upstream(tmp_path / "again.pt", state)
    assert not (tmp_path / "again.pt").exists()


@pytest.mark.parametrize("peak", [7e4, 2e4])
def test_features_are_checked_after_the_float16_cast(peak: float) -> None:
    """7e4 is finite in float32 but inf in the float16 cache (the check ran before the cast,
    so the cache held inf); 2e4 fits float16 but no trained upstream gives it."""
    x = torch.randn(2, 6, 2)
    x[0, 2, 1] = peak
    with pytest.raises(ImplausibleFeaturesError, match=f"beyond {FEATURE_LIMIT:g}") as info:
        extract_split(MelUpstream(2), [batch_of(x, [6, 4])], layers=[0], progress_bar=False)
    assert "u0" in str(info.value)
    ok = extract_split(MelUpstream(2), [batch_of(x / peak, [6, 4])], [0], progress_bar=False)
    assert bool(torch.isfinite(ok.features).all())


# ----------------------------------------------------------------------------- normalisation (14)


def test_downstream_uses_the_upstreams_normalisation_and_says_so(tmp_path: Path, caplog) -> None:
    """Corpus features left unnormalised (data.normalization=none) for an upstream pretrained
    with global statistics: mapped onto the upstream's statistics (before: fed as they were,
    silently), with a log line; `corpus` keeps them, warns, and the record says so."""
    upstream, _ = open_upstream(save_tiny_upstream(tmp_path / "up.pt", mean=1.0, std=2.0), 8)
    corpus = Normalizer(torch.zeros(8), torch.ones(8), "none")
    raw = batch_of(torch.randn(2, 5, 8), [5, 3])
    with caplog.at_level(logging.INFO, logger="speechattn.tasks.downstream.features"):
        plan = feature_normalization(corpus, upstream)
    assert plan.record == {
        "used": "upstream",
        "corpus": "none",
        "upstream": "global",
        "differ": True,
    }
    assert any("mapped onto the upstream's own global" in r.getMessage() for r in caplog.records)
    out = plan.transform(raw["features"], raw["padding_mask"])
    valid = ~raw["padding_mask"]
    expected = (raw["features"] - 1.0) / 2.0
    assert torch.equal(out[valid], expected[valid]) and not out[~valid].any()
    assert plan.cache_tag  # these features differ from the old code's: a new cache key

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="speechattn.tasks.downstream.features"):
        forced = feature_normalization(corpus, upstream, "corpus")
    assert forced.transform is None and forced.record["used"] == "corpus"
    assert forced.record["differ"] and "recorded in result.json" in caplog.text

    same = feature_normalization(Normalizer(torch.ones(8), torch.full((8,), 2.0)), upstream)
    assert same.transform is None and not same.record["differ"] and same.cache_tag == ""


def test_per_utterance_corpus_features_cannot_follow_a_global_upstream(tmp_path: Path) -> None:
    upstream, _ = open_upstream(save_tiny_upstream(tmp_path / "up.pt"), 8)
    corpus = Normalizer(torch.zeros(8), torch.ones(8), "utterance")
    with pytest.raises(ConfigError, match="data.normalization=utterance .*normalization=corpus"):
        feature_normalization(corpus, upstream)
    assert feature_normalization(corpus, upstream, "corpus").record["differ"]
    with pytest.raises(ConfigError, match="normalization='nope'"):
        feature_normalization(corpus, upstream, "nope")


# ----------------------------------------------------------------------------- wording (26)


def test_random_bytes_are_not_called_code(tmp_path: Path) -> None:
    path = tmp_path / "upstream.pt"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(UpstreamFileError, match="not a torch file") as info:
        open_upstream(path, 80)
    assert "could run code" not in str(info.value) and str(path) in str(info.value)


def test_a_folder_is_not_called_missing(tmp_path: Path) -> None:
    save_tiny_upstream(tmp_path / "run" / "upstream.pt")
    with pytest.raises(UpstreamFileError, match="is a folder, not a file") as info:
        open_upstream(tmp_path / "run", 8)
    assert "does not exist" not in str(info.value) and "upstream.pt" in str(info.value)


@pytest.fixture
def no_extraction(monkeypatch) -> None:
    """Any feature extraction fails the test: the error must come before it."""

    def extract(self) -> None:
        raise AssertionError("labelled features were extracted before the error")

    monkeypatch.setattr(LabelledDataModule, "prepare_data", extract)


@pytest.mark.slow
def test_a_misspelt_upstream_fails_before_extraction(tmp_path: Path, no_extraction) -> None:
    cfg = compose("downstream", [f"upstream={tmp_path / 'upstreem.pt'}", f"output_dir={tmp_path}"])
    with pytest.raises(MissingFileError, match="upstreem.pt does not exist"):
        run(cfg)


@pytest.mark.parametrize(
    "pretrained, data, expected",
    [
        ({"n_mels": 8, "deltas": True}, ["data.n_mels=8"], r"set data.deltas=true \(given false\)"),
        ({"n_mels": 40}, [], r"set data.n_mels=40 \(given 80\)"),
    ],
)
def test_feature_settings_differing_from_pretraining_fail_before_extraction(
    tmp_path: Path, no_extraction, pretrained: dict, data: list[str], expected: str
) -> None:
    path = save_tiny_upstream(tmp_path / "upstream.pt", **pretrained)
    cfg = compose("downstream", [f"upstream={path}", f"output_dir={tmp_path}", *data])
    with pytest.raises(ConfigError, match=expected) as info:
        run(cfg)
    assert str(path) in str(info.value)

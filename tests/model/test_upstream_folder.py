"""Upstream folders (config.json + model.safetensors): the same module as upstream.pt, bit for
bit, read without pickle; every damaged folder refused with the file and the problem named."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import speechattn
from speechattn.data.features import FeatureConfig, Normalizer
from speechattn.errors import MissingFileError, OutputExistsError
from speechattn.model import UpstreamFileError, aalbert
from speechattn.model.pruning import prune_upstream
from speechattn.model.upstream import (
    NonFiniteWeightsError,
    save_upstream,
    save_upstream_folder,
    upstream_sha256,
    upstream_state,
)


def tiny_upstream(path: Path, attention: str = "full") -> Path:
    torch.manual_seed(0)
    model = aalbert(
        feature_dim=8, dim=32, num_layers=2, num_heads=4, ffn_dim=64, attention=attention
    )
    norm = Normalizer(torch.randn(8), torch.rand(8) + 0.5)
    meta = {"steps": 5, "corpus": "embedded", "losses": (0.5, 0.25)}
    return save_upstream(path, upstream_state(model, norm, FeatureConfig(n_mels=8).to_dict(), meta))


def export(pt: Path, out: Path) -> Path:
    """The folder of `pt` as `python -m speechattn.export` writes it (without the card)."""
    up = speechattn.load_upstream(pt)
    state = upstream_state(up.model, up.normalizer, up.feature_config, up.metadata)
    return save_upstream_folder(out, state, {"file": pt.name, "sha256": upstream_sha256(pt)})


def assert_same_upstream(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    x = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([40, 23])
    with torch.no_grad():
        for ha, hb in zip(a(x, lengths).hidden_states, b(x, lengths).hidden_states, strict=True):
            assert torch.equal(ha, hb)
        wa, wb = a.attention_weights(x, lengths, 2), b.attention_weights(x, lengths, 2)
    assert torch.equal(wa, wb)
    assert a.feature_config == b.feature_config and a.normalizer.mode == b.normalizer.mode


@pytest.mark.parametrize("attention", ["full", "xbox", "ldsa"])
@pytest.mark.usefixtures("one_torch_thread")
def test_a_folder_loads_to_the_same_module_bit_for_bit(tmp_path, attention):
    pt = tiny_upstream(tmp_path / "upstream.pt", attention)
    folder = export(pt, tmp_path / "upstream")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    ref, got = speechattn.load_upstream(pt), speechattn.load_upstream(folder)
    assert_same_upstream(ref, got)
    assert got.attention_name == attention and got.metadata["losses"] == [0.5, 0.25]
    config = json.loads((folder / "config.json").read_text())
    assert config["source"] == {"file": "upstream.pt", "sha256": upstream_sha256(pt)}
    assert config["model_config"]["attention"] == attention and config["version"] == 3
    tensors = load_file(folder / "model.safetensors")
    assert torch.equal(tensors["normalizer.std"], ref.std)  # the statistics travel as tensors


def test_a_pruned_upstream_keeps_its_smaller_shapes(tmp_path):
    pt = tiny_upstream(tmp_path / "upstream.pt")
    # heads 1 and 3 of the shared layer masked at depth 1 only: pruned nowhere, a residual mask
    mask = [[1, 0, 1, 1], [1, 1, 1, 0]]
    pruned = prune_upstream(pt, torch.tensor([[1, 0, 1, 0], [1, 0, 1, 0]]), tmp_path / "p.pt")
    residual = prune_upstream(pt, torch.tensor(mask), tmp_path / "r.pt")
    for src in (pruned, residual):
        folder = export(src, tmp_path / f"{src.stem}-folder")
        ref, got = speechattn.load_upstream(src), speechattn.load_upstream(folder)
        assert_same_upstream(ref, got)
        assert got.config.pruned_heads == ref.config.pruned_heads
        assert got.config.residual_head_mask == ref.config.residual_head_mask
    assert speechattn.load_upstream(tmp_path / "p-folder").config.pruned_heads == {0: [0, 2]}


def test_loading_a_folder_never_unpickles(tmp_path, monkeypatch):
    folder = export(tiny_upstream(tmp_path / "upstream.pt"), tmp_path / "upstream")

    def refuse(*args, **kwargs):
        raise AssertionError("an upstream folder was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    speechattn.load_upstream(folder)


@pytest.fixture
def folder(tmp_path) -> Path:
    return export(tiny_upstream(tmp_path / "upstream.pt"), tmp_path / "upstream")


def rewrite_tensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def rewrite_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def test_missing_files_are_named(folder):
    (folder / "config.json").unlink()
    with pytest.raises(UpstreamFileError, match="incomplete: config.json is missing"):
        speechattn.load_upstream(folder)
    other = folder.parent / "weightless"
    export(folder.parent / "upstream.pt", other)
    (other / "model.safetensors").unlink()
    with pytest.raises(UpstreamFileError, match="incomplete: model.safetensors is missing"):
        speechattn.load_upstream(other)
    # neither: a folder of something else, with the .pt it holds suggested
    with pytest.raises(UpstreamFileError, match="is a folder, not a file.*upstream.pt"):
        speechattn.load_upstream(folder.parent)
    with pytest.raises(MissingFileError, match="nothere"):
        speechattn.load_upstream(folder.parent / "nothere")


def test_a_missing_or_unexpected_tensor_is_named(folder):
    rewrite_tensors(folder, lambda t: t.pop("head.out.bias"))
    with pytest.raises(UpstreamFileError, match=r"model.safetensors.*'head.out.bias' is missing"):
        speechattn.load_upstream(folder)
    rewrite_tensors(
        folder,
        lambda t: t.update({"head.out.bias": torch.zeros(24), "extra": torch.ones(2)}),
    )
    with pytest.raises(UpstreamFileError, match="unexpected tensor 'extra'"):
        speechattn.load_upstream(folder)
    rewrite_tensors(folder, lambda t: (t.pop("extra"), t.pop("normalizer.mean")))
    with pytest.raises(UpstreamFileError, match="'normalizer.mean' is missing"):
        speechattn.load_upstream(folder)


def test_a_tensor_of_another_shape_is_named_with_both_shapes(folder):
    rewrite_tensors(folder, lambda t: t.update({"head.out.bias": torch.zeros(25)}))
    with pytest.raises(
        UpstreamFileError, match=r"'head.out.bias' has shape \(25,\).*needs \(24,\)"
    ):
        speechattn.load_upstream(folder)


def test_a_config_that_builds_other_shapes_is_refused(folder):
    rewrite_config(folder, lambda c: c["model_config"].update(ffn_dim=32))
    with pytest.raises(UpstreamFileError, match="model.safetensors: cannot rebuild the model"):
        speechattn.load_upstream(folder)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(version=99), "config.json has upstream format version 99"),
        (lambda c: c.update(format="other"), "config.json is not a speechattn upstream"),
        (
            lambda c: c.pop("feature_config"),
            r"config.json is incomplete: missing \['feature_config'\]",
        ),
        (
            lambda c: c["model_config"].update(attention="nope"),
            "config.json: cannot rebuild the model",
        ),
    ],
)
def test_a_bad_config_is_named(folder, edit, message):
    rewrite_config(folder, edit)
    with pytest.raises(UpstreamFileError, match=message):
        speechattn.load_upstream(folder)


def test_config_that_is_not_json_is_named(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(UpstreamFileError, match="config.json is not valid JSON"):
        speechattn.load_upstream(folder)


@pytest.mark.parametrize("value", [float("nan"), 1e6])
def test_nonfinite_or_implausible_weights_are_refused(folder, value):
    def poison(t):
        t["head.out.weight"][0, 0] = value

    rewrite_tensors(folder, poison)
    with pytest.raises(NonFiniteWeightsError, match=r"model.safetensors.*head.out.weight"):
        speechattn.load_upstream(folder)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_corrupt_safetensors_file_is_named(folder, damage):
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": bytes(range(256)) * 8, "empty": b""}[
            damage
        ]
    )
    with pytest.raises(UpstreamFileError, match="model.safetensors is not a readable safetensors"):
        speechattn.load_upstream(folder)


def test_nonfinite_weights_are_never_written(tmp_path):
    up = speechattn.load_upstream(tiny_upstream(tmp_path / "upstream.pt"))
    state = upstream_state(up.model, up.normalizer, up.feature_config, up.metadata)
    state["state_dict"]["head.out.bias"][0] = float("inf")
    with pytest.raises(NonFiniteWeightsError, match="not writing"):
        save_upstream_folder(tmp_path / "out", state)
    assert not (tmp_path / "out").exists()


def test_writing_replaces_an_earlier_folder_whole_and_nothing_else(tmp_path):
    pt = tiny_upstream(tmp_path / "upstream.pt")
    up = speechattn.load_upstream(pt)
    state = upstream_state(up.model, up.normalizer, up.feature_config, up.metadata)
    out = save_upstream_folder(tmp_path / "out", state, files={"README.md": b"card"})
    before = (out / "model.safetensors").read_bytes()
    # a write that fails half-way leaves the earlier folder as it was, and no temporary one
    state["metadata"]["bad"] = object()  # not JSON: fails after model.safetensors is written
    with pytest.raises(TypeError):
        save_upstream_folder(out, state)
    assert (out / "model.safetensors").read_bytes() == before and (out / "README.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "upstream.pt"]
    del state["metadata"]["bad"]
    save_upstream_folder(out, state)  # an earlier upstream folder is replaced whole
    assert not (out / "README.md").exists()
    # anything else is never deleted
    with pytest.raises(OutputExistsError, match="upstream.pt"):
        save_upstream_folder(tmp_path, state)
    with pytest.raises(OutputExistsError, match="a file"):
        save_upstream_folder(pt, state)


def test_upstream_sha256_of_a_folder_follows_config_and_weights_not_the_card(folder):
    before = upstream_sha256(folder)
    (folder / "README.md").write_text("a new card")
    assert upstream_sha256(folder) == before
    rewrite_config(folder, lambda c: c["metadata"].update(steps=6))
    assert upstream_sha256(folder) != before

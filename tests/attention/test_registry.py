"""Registry, build errors and the Hydra group conf/attention/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from speechattn.attention import Attention, AttentionConfig, available, build, register, registry
from speechattn.config import compose

CONF = Path(__file__).resolve().parents[2] / "conf" / "attention"
ISSUE_NAMES = [
    "full", "shared_qk", "sparse_strided", "sparse_fixed", "sign_alsh", "xbox", "xbox_qnf",
    "simple_lsh", "simple_alsh", "syn_dense", "syn_dense_mh", "syn_random", "syn_fixed", "ldsa",
]  # fmt: skip


def test_all_variants_registered():
    assert set(ISSUE_NAMES) <= set(available())


def test_build_full_small():
    attn = build("full", 64, 4)
    assert isinstance(attn, Attention) and attn.num_heads == 4
    assert attn(torch.randn(2, 5, 64)).shape == (2, 5, 64)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown attention 'fulll'") as err:
        build("fulll", 64, 4)
    for name in ISSUE_NAMES:
        assert name in str(err.value)


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="'strde'.*'sparse_strided'.*valid options: .*stride"):
        build("sparse_strided", 64, 4, strde=4)


def test_invalid_shapes_rejected():
    with pytest.raises(ValueError, match="divisible"):
        build("full", 30, 4)


def test_register_refuses_duplicates_and_non_subclasses():
    with pytest.raises(ValueError, match="already registered"):
        register("full")(registry.get("shared_qk"))
    with pytest.raises(TypeError, match="not a subclass"):
        register("not_an_attention")(torch.nn.Linear)
    assert "not_an_attention" not in available()


def test_options_lists_defaults():
    assert registry.options("ldsa") == {"context": 15}
    lsh = {
        "k": 32, "bits": 16, "seed": 0, "normalize_keys": True, "tie_break": "score",
        "hash": "sign", "bucket_width": 2.5, "hash_keys": "scored",
    }  # fmt: skip
    assert registry.options("sign_alsh") == lsh
    assert registry.options("xbox") == {**lsh, "hash": "l2"}  # its paper's hash


@pytest.mark.parametrize("name", available())
def test_one_conf_file_per_variant(name):
    """attention=NAME composes the variant's options (its config's defaults, which every
    override may change without a `+`) and builds it."""
    cfg = compose("pretrain", [f"attention={name}"]).attention
    assert cfg.name == name
    options = OmegaConf.to_container(cfg.options)
    assert set(options) <= set(registry.options(name)) | {"dropout", "bias"}
    attn = build(cfg.name, 32, 4, **options)
    assert attn.name == name
    first = next(iter(registry.options(name)), None)
    if first is not None:
        value = registry.options(name)[first]
        override = f"attention.options.{first}={'null' if value is None else value}"
        assert compose("pretrain", [f"attention={name}", override]).attention.name == name


def test_no_stray_conf_files():
    assert {p.stem for p in CONF.glob("*.yaml")} == set(available())


def test_config_is_a_dataclass_subclass():
    for name in available():
        assert issubclass(registry.get(name).Config, AttentionConfig)

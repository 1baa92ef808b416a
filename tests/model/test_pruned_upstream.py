"""Actual pruning: `AALBERT.prune_heads` and `prune_upstream` equal the head-masked model."""

from __future__ import annotations

import json

import pytest
import torch

import speechattn
from speechattn.data.features import FeatureConfig, Normalizer
from speechattn.model import aalbert, load_upstream
from speechattn.model.aalbert import pruning_plan
from speechattn.model.pruning import prune_from_heads, prune_upstream, pruning_point
from speechattn.model.upstream import save_upstream, upstream_state

L, H = 3, 4
# Depth x head, 0 = masked. Head 1 is masked at every depth, head 2 at depths 0 and 2 only,
# depth 1 loses three heads: an unshared model removes 7 heads, a shared one only head 1.
MASK = torch.tensor(
    [[1, 0, 0, 1], [0, 0, 1, 0], [1, 0, 0, 1]],
    dtype=torch.float64,
)
OPTIONS = {"syn_fixed": {"max_len": 32}, "ldsa": {"context": 3}, "routing": {"window": 2}}


def _model(attention: str, shared: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = aalbert(
        feature_dim=8, dim=32, num_layers=L, num_heads=H, ffn_dim=48, shared=shared,
        attention=attention, attention_options=OPTIONS.get(attention, {}),
    )  # fmt: skip
    return model.double().eval()


def _inputs():
    g = torch.Generator().manual_seed(5)
    return torch.randn(2, 40, 8, generator=g, dtype=torch.float64), torch.tensor([40, 23])


def _assert_same(hidden, reference):
    assert len(hidden) == len(reference) == L + 1
    for a, b in zip(hidden, reference):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared"])
@pytest.mark.parametrize("attention", ["full", "ldsa", "sparse_strided", "syn_fixed", "routing"])
def test_pruned_model_equals_head_masked_model(attention, shared):
    full, pruned = _model(attention, shared), _model(attention, shared)
    pruned.prune_heads(MASK)
    x, lengths = _inputs()
    with torch.no_grad():
        _assert_same(pruned(x, lengths), full(x, lengths, MASK))
        # a run-time head mask still has the original (L, h) shape and composes with pruning
        xi = torch.rand(L, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        _assert_same(pruned(x, lengths, xi), full(x, lengths, MASK * xi))
    removed = 7 if not shared else 1
    heads = [layer.attention.num_heads for layer in pruned.encoder.layers]
    assert sum(heads) == len(heads) * H - removed
    assert pruned.get_num_params() < full.get_num_params()


def test_shared_layer_prunes_only_heads_masked_at_every_depth():
    keep, residual = pruning_plan(MASK, [0, 0, 0])
    assert keep == {0: [0, 2, 3]}
    assert residual is not None and residual.tolist() == MASK.tolist()
    keep, residual = pruning_plan(MASK, [0, 1, 2])
    assert keep == {0: [0, 3], 1: [2], 2: [0, 3]} and residual is None
    # a depth with every head masked keeps head 0, masked by the residual mask
    keep, residual = pruning_plan(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), [0, 1])
    assert keep == {0: [0, 1], 1: [0]} and residual.tolist() == [[1, 1], [0, 0]]


def test_fully_masked_unshared_depth_equals_masked_model():
    mask = MASK.clone()
    mask[1] = 0
    full, pruned = _model("full", False), _model("full", False)
    pruned.prune_heads(mask)
    assert pruned.encoder.layers[1].attention.num_heads == 1
    x, lengths = _inputs()
    with torch.no_grad():
        _assert_same(pruned(x, lengths), full(x, lengths, mask))


def test_prune_by_layer_mapping_and_repeated_pruning():
    full, pruned = _model("full", False), _model("full", False)
    pruned.prune_heads({0: [0, 1, 3], 2: [1, 3]})
    pruned.prune_heads({0: [0, 3]})  # original indices again
    assert pruned.config.pruned_heads == {0: [0, 3], 2: [1, 3]}
    mask = torch.ones(L, H, dtype=torch.float64)
    mask[0, [1, 2]] = 0
    mask[2, [0, 2]] = 0
    x, lengths = _inputs()
    with torch.no_grad():
        _assert_same(pruned(x, lengths), full(x, lengths, mask))


def _save(model, path):
    meta = {"steps": 3, "corpus": "embedded", "code_version": speechattn.code_version()}
    norm = Normalizer(torch.zeros(8), torch.ones(8))
    return save_upstream(
        path, upstream_state(model.float(), norm, FeatureConfig(n_mels=8).to_dict(), meta)
    )


@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared"])
@pytest.mark.parametrize("attention", ["full", "sparse_fixed", "relpos"])
def test_pruned_upstream_loads_and_equals_masked_upstream(tmp_path, attention, shared):
    src = _save(_model(attention, shared), tmp_path / "upstream.pt")
    dst = prune_upstream(src, MASK.tolist(), tmp_path / "pruned" / "upstream.pt")
    original, pruned = load_upstream(src).double(), load_upstream(dst).double()
    x, lengths = _inputs()
    with torch.no_grad():
        _assert_same(pruned(x, lengths).hidden_states, original(x, lengths, MASK).hidden_states)
    assert pruned.num_heads == H and pruned.config.pruned_heads
    record = pruned.metadata["pruning"]
    assert record["params_after"] < record["params_before"] and record["shared"] is shared
    assert pruned.metadata["steps"] == 3 and dst.stat().st_size < src.stat().st_size


def test_files_without_pruning_keys_load_unpruned(tmp_path):
    model = _model("full", True)
    state = upstream_state(model.float(), Normalizer(torch.zeros(8), torch.ones(8)), {}, {})
    del state["model_config"]["pruned_heads"], state["model_config"]["residual_head_mask"]
    path = save_upstream(tmp_path / "old.pt", state)
    up = load_upstream(path)
    assert up.model.encoder.layers[0].attention.num_heads == H
    assert up.config.pruned_heads == {} and up.config.residual_head_mask is None


def test_prune_from_heads_json_point(tmp_path):
    src = _save(_model("full", False), tmp_path / "upstream.pt")
    ones = torch.ones(L, H)
    heads = {
        "upstream": str(src),
        "upstream_sha256": speechattn.data.cache.file_sha256(src),
        "metric": "l1_loss",
        "task": "pretrain",
        "pruning": {
            "points": [
                {"num_masked": 0, "fraction": 0.0, "metric": 1.0, "mask": ones.tolist()},
                {"num_masked": 7, "fraction": 0.5, "metric": 1.2, "mask": MASK.tolist()},
            ]
        },
    }
    assert pruning_point(heads, 0.3)["fraction"] == 0.5
    assert pruning_point(heads, 0.25)["fraction"] == 0.0  # tie: the smaller fraction
    dst = prune_from_heads(heads, 0.4, tmp_path / "pruned.pt")
    up = load_upstream(dst)
    assert up.metadata["pruning"]["heads_num_masked"] == 7
    assert up.config.pruned_heads == {0: [0, 3], 1: [2], 2: [0, 3]}
    heads["upstream_sha256"] = "0" * 64
    with pytest.raises(ValueError, match="not the upstream"):
        prune_from_heads(heads, 0.4, tmp_path / "other.pt")


@pytest.mark.slow
def test_prune_command_writes_the_pruned_upstream(tmp_path):
    """`python -m speechattn.prune heads=... fraction=... out=...` on a minimal heads.json."""
    import subprocess
    import sys

    from speechattn.tasks.records import HEADS_SCHEMA_VERSION, KIND, write_heads

    src = _save(_model("ldsa", True), tmp_path / "upstream.pt")
    zeros = torch.zeros(L, H).tolist()
    points = [
        {"num_masked": 0, "fraction": 0.0, "metric": 1.0, "mask": torch.ones(L, H).tolist()},
        {"num_masked": 7, "fraction": 7 / 12, "metric": 1.3, "mask": MASK.tolist()},
    ]
    heads = {
        "schema_version": HEADS_SCHEMA_VERSION, "kind": KIND, "task": "pretrain", "metric": "l1_loss",
        "higher_is_better": False, "base_metric": 1.0, "num_layers": L, "num_heads": H,
        "attention": "ldsa", "upstream": str(src),
        "upstream_sha256": speechattn.data.cache.file_sha256(src),
        "importance": {"raw": zeros, "normalized": zeros}, "ablation": {},
        "pruning": {"points": points}, "seed": 0, "code_version": "test",
    }  # fmt: skip
    folder = write_heads(heads, tmp_path / "analysis")
    out = tmp_path / "pruned.pt"
    cmd = [sys.executable, "-m", "speechattn.prune", f"heads={folder}", "fraction=0.6"]
    cmd += [f"out={out}", f"hydra.run.dir={tmp_path / 'run'}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    up = load_upstream(out)
    assert up.config.pruned_heads == {0: [0, 2, 3]} and up.config.residual_head_mask
    assert json.loads(json.dumps(up.metadata["pruning"]))["heads_num_masked"] == 7


@pytest.mark.usefixtures("one_torch_thread")  # `--threads 1` sets torch's threads: restored after
def test_pruning_benchmark_runs_and_reports(tmp_path, capsys):
    from speechattn.bench import pruning as bench

    path = tmp_path / "bench.json"
    argv = ["--model", "aalbert_tiny", "--attention", "sparse_fixed", "--fraction", "0.5"]
    argv += ["--batch", "1", "--frames", "12", "--reps", "1", "--threads", "1", "--json", str(path)]
    bench.main(argv)
    out = json.loads(path.read_text())
    assert out["shared"] and out["max_abs_diff"] < 1e-4
    assert out["rows"]["pruned"]["params"] < out["rows"]["masked"]["params"]
    assert out["speedup"] > 0 and "speed-up (masked / pruned time)" in capsys.readouterr().out


@pytest.mark.parametrize("heads", [{3: [0]}, {0: []}, {1: [4]}])
def test_bad_layer_mappings_are_refused(heads):
    with pytest.raises(ValueError, match="heads to keep"):
        _model("full", False).prune_heads(heads)


def test_head_mask_of_the_pruned_width_is_refused():
    pruned = _model("full", False)
    pruned.prune_heads(MASK)
    x, lengths = _inputs()
    with pytest.raises(ValueError, match="before pruning"):
        pruned(x, lengths, torch.ones(L, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="head mask"):
        pruned.prune_heads(torch.ones(L, 2))

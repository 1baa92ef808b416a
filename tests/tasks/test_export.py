"""Upstream folders from pretraining and `python -m speechattn.export`, and continued
pretraining (`init_from=PATH`): its weights, its refusals and the parent it records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from _pretrain_testing import SyntheticPretrainData, compose_pretrain

import speechattn
from speechattn.errors import ConfigError
from speechattn.export import main as export_main
from speechattn.model.upstream import upstream_sha256
from speechattn.pretrain import run
from speechattn.tasks.downstream.features import open_upstream
from speechattn.tasks.pretrain import PretrainTask
from speechattn.tasks.pretrain.resume import check_init_resume, differences

SYNTH = ("~data",)  # SyntheticPretrainData goes to run() directly


def read_card(path: Path) -> tuple[dict, str]:
    text = path.read_text()
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ----------------------------------------------------------------------------- export


def test_a_pretraining_run_writes_its_upstream_folder(pretrained_tiny_run: Path):
    pt, folder = pretrained_tiny_run / "upstream.pt", pretrained_tiny_run / "upstream"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["README.md", "config.json", "loss_curve.png", "model.safetensors"]
    ref, got = speechattn.load_upstream(pt), speechattn.load_upstream(folder)
    assert_same_weights(ref, got)
    config = json.loads((folder / "config.json").read_text())
    assert config["source"] == {"file": "upstream.pt", "sha256": upstream_sha256(pt)}
    card, body = read_card(folder / "README.md")
    run_card, _ = read_card(pretrained_tiny_run / "README.md")
    assert card["library_name"] == "speechattn" and card["license"] == run_card["license"]
    assert card["pipeline_tag"] == "feature-extraction" and "attention-full" in card["tags"]
    assert card["upstream_sha256"] == upstream_sha256(pt)
    assert 'load_upstream(".")' in body  # the folder loads from inside it
    # the downstream probes and the head analysis open it (and key caches) by its contents
    up, sha = open_upstream(folder, feature_dim=got.feature_dim)
    assert sha == upstream_sha256(folder) != upstream_sha256(pt)
    assert_same_weights(up, ref)


def test_export_writes_a_folder_that_loads_as_the_upstream(pretrained_tiny_run: Path, tmp_path):
    pt = pretrained_tiny_run / "upstream.pt"
    out = tmp_path / "hub" / "my-upstream"
    assert export_main([str(pt), str(out), "--license", "cc-by-4.0"]) == 0
    assert_same_weights(speechattn.load_upstream(out), speechattn.load_upstream(pt))
    card, _ = read_card(out / "README.md")
    assert card["license"] == "cc-by-4.0"
    # exporting again replaces the folder; the license defaults to the run's card's
    assert export_main([str(pt), str(out)]) == 0
    assert read_card(out / "README.md")[0]["license"] == "mit"


@pytest.mark.parametrize(
    "which, message",
    [
        ("missing", "does not exist"),
        ("run_folder", "is a folder holding"),  # never deletes a folder of other files
        ("not_upstream", "not a readable speechattn upstream file"),
    ],
)
def test_export_errors_are_one_line_with_status_1(
    pretrained_tiny_run: Path, tmp_path, capsys, which, message
):
    pt, out = pretrained_tiny_run / "upstream.pt", tmp_path / "out"
    if which == "missing":
        pt = tmp_path / "nothing.pt"
    elif which == "run_folder":
        out = pretrained_tiny_run
    else:
        pt = tmp_path / "bad.pt"
        pt.write_text("not a torch file")
    with pytest.raises(SystemExit) as exited:
        export_main([str(pt), str(out)])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m speechattn.export: error: ") and "\n" not in err
    assert message in err
    assert (pretrained_tiny_run / "upstream.pt").is_file() and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- init_from


@pytest.fixture(scope="module")
def parent_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parent")
    run(compose_pretrain(out, *SYNTH, "attention=ldsa"), datamodule=SyntheticPretrainData())
    return out


@pytest.mark.parametrize("source", ["upstream.pt", "upstream"])
def test_init_from_starts_a_new_run_from_the_parents_weights(
    parent_run: Path, tmp_path, monkeypatch, source
):
    parent = parent_run / source
    at_start: dict[str, torch.Tensor] = {}

    def record(task: PretrainTask) -> None:  # the weights the first step starts from
        assert task.global_step == 0
        at_start.update({k: v.clone() for k, v in task.model.state_dict().items()})

    monkeypatch.setattr(PretrainTask, "on_train_start", record, raising=False)
    cfg = compose_pretrain(
        tmp_path, *SYNTH, "attention=ldsa", f"init_from={parent}", "trainer.max_steps=4"
    )
    result = run(cfg, datamodule=SyntheticPretrainData())
    ref = speechattn.load_upstream(parent).model.state_dict()
    assert list(at_start) == list(ref)
    for k, v in ref.items():
        assert torch.equal(at_start[k], v), k
    assert result["steps"] == 4  # a new run: its own steps from 0, not the parent's 8 + 4

    record_ = {"path": str(parent.resolve()), "sha256": upstream_sha256(parent)}
    child = speechattn.load_upstream(result["upstream"])
    assert child.metadata["init_from"] == record_ and child.metadata["steps"] == 4
    assert read_card(tmp_path / "README.md")[0]["init_from"] == record_
    config = json.loads((tmp_path / "upstream" / "config.json").read_text())
    assert config["metadata"]["init_from"] == record_
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["speechattn_data"]["init_from"] == record_  # what a resume checks


def test_init_from_refuses_another_architecture_naming_each_difference(parent_run, tmp_path):
    cfg = compose_pretrain(
        tmp_path,
        *SYNTH,
        "attention=full",
        "model.net.num_heads=4",
        "model.net.dropout=0.2",  # a training setting: may change
        f"init_from={parent_run / 'upstream.pt'}",
    )
    with pytest.raises(ConfigError) as refused:
        run(cfg, datamodule=SyntheticPretrainData())
    message = str(refused.value)
    assert "model.net.num_heads: upstream 2, this run 4" in message
    assert "attention: upstream 'ldsa', this run 'full'" in message
    assert "attention.options." in message  # ldsa's options, which full lacks
    assert "dropout" not in message
    assert not (tmp_path / "metrics.csv").exists()  # refused before training


def test_init_from_refuses_other_input_features(parent_run):
    parent = speechattn.load_upstream(parent_run / "upstream.pt")
    features = {"n_mels": 40, "deltas": True}
    found = differences(parent, parent.config, features, "utterance")
    assert found == [
        "data.n_mels: upstream 80, this run 40",
        "data.deltas: upstream False, this run True",
        "data.normalization: upstream 'global', this run 'utterance'",
    ]
    assert differences(parent, parent.config, parent.feature_config, "global") == []


def test_init_from_with_a_checkpoint_resumes_only_the_run_it_started(parent_run, tmp_path):
    parent = parent_run / "upstream.pt"
    record = {"path": str(parent), "sha256": upstream_sha256(parent)}
    check_init_resume(parent, {"speechattn_data": {"init_from": record}}, Path("last.ckpt"))
    other = {"path": "/x/upstream.pt", "sha256": "0" * 64}
    for data in ({}, {"init_from": other}):
        with pytest.raises(ConfigError, match="ambiguous"):
            check_init_resume(parent, {"speechattn_data": data}, Path("last.ckpt"))
    # through run(): the parent's own checkpoint was trained from scratch
    ckpt = parent_run / "checkpoints" / "last.ckpt"
    cfg = compose_pretrain(
        tmp_path, *SYNTH, "attention=ldsa", f"init_from={parent}", f"ckpt_path={ckpt}"
    )
    with pytest.raises(ConfigError, match="started from scratch, not from this upstream"):
        run(cfg, datamodule=SyntheticPretrainData())


@pytest.mark.slow
def test_python_m_speechattn_export(pretrained_tiny_run: Path, tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "speechattn.export"]
    done = subprocess.run(
        [*command, str(pretrained_tiny_run / "upstream.pt"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert speechattn.load_upstream(tmp_path / "out").num_layers == 2
    done = subprocess.run(
        [*command, str(tmp_path / "missing.pt"), str(tmp_path / "out2")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "missing.pt" in done.stderr

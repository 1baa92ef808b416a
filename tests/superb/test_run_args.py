"""What `python -m speechattn.superb` hands to run_downstream.py (no s3prl run needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from speechattn.errors import ConfigError
from speechattn.superb.prepare import DATA_FILE, LAYOUT_VERSION
from speechattn.superb.run import build_argv


def fake_prepared(folder: Path) -> Path:
    folder.mkdir(parents=True)
    config = {"downstream_expert.datarc.speech_commands_root": str(folder / "train"),
              "downstream_expert.datarc.speech_commands_test_root": str(folder / "test")}  # fmt: skip
    record = {"task": "speech_commands", "layout_version": LAYOUT_VERSION, "config": config}
    (folder / DATA_FILE).write_text(json.dumps(record))
    return folder


def test_train_gets_device_expdir_and_the_task_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "upstream.pt").write_bytes(b"x")
    data = fake_prepared(tmp_path / "ks")
    argv = ["-m", "train", "-u", "speechattn", "-k", "run/upstream.pt", "-d", "speech_commands"]
    out, decided = build_argv(argv, quick=True, data=str(data))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    expdir = Path("result/superb/speech_commands-quick/speechattn-run")
    assert out == [*argv, "--device", device, "-p", str(expdir),
                   "-c", str(expdir / "superb_config_quick.yaml")]  # fmt: skip
    config = yaml.safe_load((expdir / "superb_config_quick.yaml").read_text())
    assert config["runner"]["total_steps"] == 300
    assert config["downstream_expert"]["datarc"]["speech_commands_root"] == str(data / "train")
    # explicit choices are kept
    out, _ = build_argv([*argv, "--device", "cpu", "-p", "x"], quick=False, data=str(data))
    assert out.count("--device") == 1 and out.count("-p") == 1
    assert yaml.safe_load(Path("x/superb_config.yaml").read_text())["optimizer"]["lr"] == 1e-4


@pytest.mark.parametrize(
    ("ckpt", "name"),
    [("run/upstream", "speechattn-run"), ("shared/my_model", "speechattn-my_model")],
)
def test_an_upstream_folder_is_an_upstream(ckpt, name, tmp_path, monkeypatch):
    """-k takes an upstream folder too: a run's `upstream/` names the experiment after the
    run, as its upstream.pt does; an exported folder after itself."""
    monkeypatch.chdir(tmp_path)
    Path(ckpt).mkdir(parents=True)
    data = fake_prepared(tmp_path / "ks")
    argv = ["-m", "train", "-u", "speechattn", "-k", ckpt, "-d", "speech_commands"]
    out, _ = build_argv(argv, quick=True, data=str(data))
    assert out[out.index("-p") + 1] == str(Path("result/superb/speech_commands-quick") / name)


def test_mistakes_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="-k missing.pt: no such file or folder"):
        build_argv(
            ["-m", "train", "-u", "speechattn", "-k", "missing.pt", "-d", "ctc"], False, None
        )
    with pytest.raises(ConfigError, match="-u speechattn needs -k"):
        build_argv(["-m", "train", "-u", "speechattn", "-d", "ctc"], False, None)
    with pytest.raises(ConfigError, match="no dev-best.ckpt or states-"):
        build_argv(["-m", "evaluate", "-u", "fbank_no_cmvn", "-d", "ctc"], False, None)
    with pytest.raises(ConfigError, match="--push_to_hf_hub"):
        build_argv(
            ["-m", "train", "-u", "fbank", "-d", "ctc", "--push_to_hf_hub", "True"], False, None
        )
    with pytest.raises(ConfigError, match="no prepared speech_commands data"):
        build_argv(["-m", "train", "-u", "fbank", "-d", "speech_commands"], False, str(tmp_path))
    with pytest.raises(ConfigError, match="-d asr: speechattn ships SUPERB configs"):
        build_argv(["-m", "train", "-u", "fbank", "-d", "asr"], False, None)


class _Crafted:
    """An object whose unpickling would run code (os.system): must never be loaded."""

    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_evaluate_refuses_a_crafted_or_foreign_checkpoint_naming_it(tmp_path):
    crafted = tmp_path / "states-100.ckpt"
    torch.save({"Args": _Crafted()}, crafted)
    with pytest.raises(ConfigError, match=rf"-e checkpoint {crafted}: .*states-\*\.ckpt"):
        build_argv(["-m", "evaluate", "-e", str(crafted)], quick=False, data=None)
    foreign = tmp_path / "weights.ckpt"
    torch.save({"model": torch.zeros(2)}, foreign)
    with pytest.raises(ConfigError, match="not a checkpoint of s3prl's runner"):
        build_argv(["-m", "evaluate", "-e", str(foreign)], quick=False, data=None)


def test_featurizer_weights_are_read_weights_only_and_shown_as_softmax(tmp_path, capsys):
    import argparse

    from speechattn.superb.weights import layer_weights, main

    ckpt = tmp_path / "states-300.ckpt"
    raw = torch.tensor([0.0, 1.0, 2.0])
    torch.save({"Args": argparse.Namespace(upstream="speechattn"), "Featurizer": {"weights": raw}},
               ckpt)  # fmt: skip
    assert layer_weights(tmp_path) == pytest.approx(torch.softmax(raw, 0).tolist())
    main([str(ckpt)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "layer  weight" and lines[3].startswith("    2  0.6652")
    torch.save({"Args": argparse.Namespace(upstream="speechattn")}, ckpt)
    with pytest.raises(ConfigError, match="no Featurizer layer weights"):
        layer_weights(ckpt)

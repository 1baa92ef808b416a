"""Resuming pretraining (`speechattn.tasks.pretrain.resume`): which checkpoint `ckpt_path=last`
means, what a resume may change, one run per run directory, and what a stopped extension
leaves. Runs are in this process on the synthetic data of _pretrain_testing.py (a few steps each)."""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _pretrain_testing import SyntheticPretrainData, compose_pretrain
from hydra.core.override_parser.overrides_parser import OverridesParser
from test_preemption import SignalAt, child_env, with_callback

from speechattn.data.claims import host_name
from speechattn.errors import ConfigError
from speechattn.model.serialization import TorchFileError
from speechattn.pretrain import run
from speechattn.tasks.preemption import TrainingStopped
from speechattn.tasks.pretrain.resume import RunInUseError, newest_checkpoint, override

SYNTH = ("~data", "+data.normalization=global")  # data_config records the normalisation


def pretrain(out: Path, *overrides: str) -> dict:
    return run(compose_pretrain(out, *SYNTH, *overrides), datamodule=SyntheticPretrainData())


def step_of(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["global_step"])


def upstream_metadata(out: Path) -> dict:
    return torch.load(out / "upstream.pt", weights_only=True)["metadata"]


# ------------------------------------------------------------------------- a stopped extension


def test_sigterm_while_extending_a_finished_run_says_the_upstream_is_the_earlier_one(
    tmp_path, monkeypatch
):
    pretrain(tmp_path, "trainer.max_steps=8")
    assert upstream_metadata(tmp_path)["steps"] == 8
    with_callback(monkeypatch, SignalAt("on_train_batch_start", 12))
    with pytest.raises(TrainingStopped) as stopped:
        pretrain(tmp_path, "trainer.max_steps=16", "ckpt_path=last")
    assert stopped.value.code == 128 + signal.SIGTERM  # never 0 without a result
    message = str(stopped.value)
    assert f"{tmp_path / 'upstream.pt'} (and README.md, its model card) is an earlier " in message
    assert "at step 8; this run has no result until it is resumed and finishes" in message
    assert upstream_metadata(tmp_path)["steps"] == 8  # untouched, and said to be the old one
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 13


# ---------------------------------------------------------------------- the newest checkpoint


def test_ckpt_path_last_finds_the_newest_checkpoint_in_a_copied_run_dir(tmp_path):
    first = tmp_path / "first"
    pretrain(first, "trainer.max_steps=8")
    copied = tmp_path / "copied"
    shutil.copytree(first, copied)
    pretrain(copied, "trainer.max_steps=12", "ckpt_path=last")
    checkpoints = copied / "checkpoints"
    # Lightning did not take the copied last.ckpt for its own and wrote last-v1.ckpt beside it
    assert not list(checkpoints.glob("*-v*.ckpt"))
    assert step_of(checkpoints / "last.ckpt") == 12

    # whatever names an older Lightning (or a copy by hand) left, the highest step wins
    shutil.copy(checkpoints / "last.ckpt", checkpoints / "last-v1.ckpt")
    shutil.copy(checkpoints / "step=0000004.ckpt", checkpoints / "last.ckpt")
    assert newest_checkpoint(checkpoints) == checkpoints / "last-v1.ckpt"
    result = pretrain(copied, "trainer.max_steps=16", "ckpt_path=last")
    assert result["steps"] == 16 and upstream_metadata(copied)["steps"] == 16
    assert step_of(checkpoints / "step=0000012.ckpt") == 12  # resumed at 12, not at 4


# ------------------------------------------------------------------------ what may change


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A 4-step run (2 heads, 2 layers, lamb at lr 1e-2, global normalisation)."""
    out = tmp_path_factory.mktemp("finished")
    pretrain(out, "trainer.max_steps=4")
    return out


@pytest.mark.parametrize(
    ("change", "listed"),
    [
        ("model.net.num_heads=4", "model.net.num_heads: 2 in the checkpoint, 4 now"),
        ("model.net.num_layers=3", "model.net.num_layers: 2 in the checkpoint, 3 now"),
        ("model.optimizer.lr=0.001", "model.optimizer.lr: 0.01 in the checkpoint, 0.001 now"),
        ("data.normalization=utterance", "data.normalization: 'global' in the checkpoint, "),
        ("model.optimizer.name=adamw", "model.optimizer.name: 'lamb' in the checkpoint, 'adamw'"),
    ],
)
def test_resuming_with_other_settings_is_refused_listing_them(finished, tmp_path, change, listed):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    with pytest.raises(ConfigError) as refused:
        pretrain(out, "trainer.max_steps=8", "ckpt_path=last", change)
    message = str(refused.value)
    assert message.startswith(f"ckpt_path={out / 'checkpoints' / 'last.ckpt'} (step 4) ")
    assert listed in message
    if "optimizer.name" in change:
        assert "cannot change in a resume" in message
    else:
        assert f"allow_resume_changes=[{change.split('=')[0]}]" in message
    assert upstream_metadata(out)["steps"] == 4  # nothing trained, nothing rewritten


def test_an_allowed_change_takes_effect_and_is_recorded(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    pretrain(
        out,
        "trainer.max_steps=8",
        "ckpt_path=last",
        "model.optimizer.lr=0.001",
        "model.net.num_heads=4",
        "allow_resume_changes=[model.optimizer.lr,model.net.num_heads]",
    )
    meta = upstream_metadata(out)
    assert meta["steps"] == 8 and meta["optimizer"]["lr"] == 0.001
    assert meta["resume_changes"] == [
        {"step": 4, "setting": "model.net.num_heads", "checkpoint": 2, "now": 4},
        {"step": 4, "setting": "model.optimizer.lr", "checkpoint": 0.01, "now": 0.001},
    ]
    assert torch.load(out / "upstream.pt", weights_only=True)["model_config"]["num_heads"] == 4
    # the optimiser trained at the new lr, not at the checkpoint's (Lightning restores that)
    last = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert [g["initial_lr"] for g in last["optimizer_states"][0]["param_groups"]] == [0.001] * 2
    assert last["lr_schedulers"][0]["base_lrs"] == [0.001] * 2


def test_weights_that_do_not_fit_and_plain_dicts_name_the_file(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    last = out / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"its weights do not fit the model configured now") as e:
        pretrain(
            out,
            "ckpt_path=last",
            "model.net.ffn_dim=48",
            "allow_resume_changes=[model.net.ffn_dim]",
        )
    assert str(e.value).startswith(f"ckpt_path={last}: ") and "(64, 32) vs (48, 32)" in str(e.value)

    plain = tmp_path / "weights.ckpt"
    torch.save(torch.load(last, weights_only=True)["state_dict"], plain)
    with pytest.raises(TorchFileError) as e:
        pretrain(tmp_path / "other", f"ckpt_path={plain}")
    assert str(e.value).startswith(
        f"ckpt_path={plain}: not a checkpoint of `python -m speechattn.pretrain` (a plain dict of "
    )


# ------------------------------------------------------------------------ one run per run dir


@pytest.mark.slow
def test_a_run_dir_in_use_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path\n"
            "from speechattn.tasks.pretrain.resume import RunLock\n"
            "RunLock(Path(sys.argv[1])).__enter__(); print('held', flush=True); time.sleep(120)",
            str(out),
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunInUseError) as refused:
            pretrain(out, "trainer.max_steps=4")
        assert f"run directory {out} is in use by another run (" in str(refused.value)
        assert f"pid {holder.pid}, started " in str(refused.value)
        assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()
    finally:
        holder.kill()  # SIGKILL: its lock file stays behind
        holder.wait()
    assert (out / "run.claim").exists()
    pretrain(out, "trainer.max_steps=4")
    assert f"took over the claim of {host_name()} pid {holder.pid}" in caplog.text
    assert upstream_metadata(out)["steps"] == 4 and not (out / "run.claim").exists()


def test_a_stopped_run_keeps_its_lock_however_long_it_is_silent(tmp_path):
    """A run of this machine stopped (kill -STOP) for longer than the lock's expiry is still
    alive: a second run in its folder is refused, never handed the lock (two runs would then
    write one folder)."""
    import json
    import os

    from speechattn.data.claims import _machine

    out = tmp_path / "run"
    out.mkdir()
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        claim = out / "run.claim"
        claim.write_text(json.dumps({"host": host_name(), "pid": stopped.pid, "started": 0,
                                     "token": "theirs", "machine": _machine()}))  # fmt: skip
        os.utime(claim, (0, 0))  # silent for decades
        with pytest.raises(RunInUseError, match=f"pid {stopped.pid}"):
            pretrain(out, "trainer.max_steps=4")
        assert json.loads(claim.read_text())["token"] == "theirs"
    finally:
        stopped.kill()
        stopped.wait()


def test_a_run_whose_lock_was_taken_over_writes_nothing_more(tmp_path, monkeypatch):
    """Fencing: a run whose lock another host's run took over (it was silent past the expiry)
    finds out at its next write, by the claim's token, and stops there naming the holder: no
    metrics row, checkpoint or upstream.pt after the takeover."""
    import json

    import lightning as L

    from speechattn.tasks.pretrain.resume import RunLockLost

    out = tmp_path / "run"

    class TakeOver(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                (out / "run.claim").write_text(json.dumps(
                    {"host": "node9", "pid": 7, "started": 0, "token": "theirs", "machine": "m9"}
                ))  # fmt: skip

    with_callback(monkeypatch, TakeOver())
    with pytest.raises(RunLockLost, match=r"lock .* was by node9 pid 7 while this run was silent"):
        pretrain(out, "trainer.max_steps=8", "trainer.log_every_n_steps=1")
    steps = [int(line.split(",")[0]) for line in (out / "metrics.csv").read_text().splitlines()[1:]]
    assert max(steps) == 3 and not (out / "upstream.pt").exists()
    assert json.loads((out / "run.claim").read_text())["token"] == "theirs"  # theirs, kept


# --------------------------------------------------------------------------- hints that paste


def test_overrides_in_hints_survive_the_shell_and_hydras_parser(tmp_path):
    parser = OverridesParser.create()
    for value in (
        str(tmp_path / "checkpoints" / "step=0000030.ckpt"),
        "/runs/multirun/attention=ldsa,seed=1/0",
        "/runs/it's here",
        "/runs/plain-dir_1",
    ):
        (word,) = shlex.split(override("ckpt_path", value))
        (parsed,) = parser.parse_overrides([word])
        assert parsed.key_or_group == "ckpt_path" and parsed.value() == value
    assert override("ckpt_path", "/runs/plain-dir_1") == "ckpt_path=/runs/plain-dir_1"


def test_the_truncated_checkpoint_hint_pastes_into_hydra(tmp_path):
    pretrain(tmp_path, "trainer.max_steps=8", "checkpoint.every_n_steps=4")
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "last.ckpt").write_bytes((checkpoints / "last.ckpt").read_bytes()[:5000])
    with pytest.raises(TorchFileError) as info:
        pretrain(tmp_path, "trainer.max_steps=12", "ckpt_path=last")
    hint = str(info.value).split("(step 8): ")[1]
    (word,) = shlex.split(hint)
    (parsed,) = OverridesParser.create().parse_overrides([word])
    assert parsed.value() == str(checkpoints / "step=0000008.ckpt")
    # the override as pasted resumes
    result = pretrain(tmp_path, "trainer.max_steps=12", word)
    assert result["steps"] == 12

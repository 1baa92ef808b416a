"""CI: keyword spotting through s3prl 0.4.18's unmodified run_downstream.py (train + evaluate),
on a Speech Commands set made from the tiny built-in corpus, with a speechattn upstream and with
s3prl's `fbank_no_cmvn` baseline; then the trained Featurizer on our expert against
`load_upstream`'s hidden states.

The runner runs in a subprocess: s3prl's `main()` replaces `builtins.isinstance` and the torch
sharing strategy process-wide, which must not leak into the test session.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import speechattn

interfaces = pytest.importorskip("s3prl.upstream.interfaces")
pytest.importorskip("tensorboardX")  # the runner's logger (the s3prl extra)

from speechattn.superb import compat  # noqa: E402
from speechattn.superb.prepare import prepare  # noqa: E402
from speechattn.tasks.records import read_superb  # noqa: E402

STEPS = 4
# one process runs the four commands (s3prl's imports dominate a start)
SCRIPT = """
import sys
from speechattn.superb.run import main
for argv in sys.argv[1:]:
    main(argv.split("|"))
"""


def commands(upstream_pt: Path, data: Path, out: Path) -> list[list[str]]:
    short = f"config.runner.total_steps={STEPS},,config.runner.eval_step={STEPS},," \
            f"config.runner.save_step={STEPS},,config.runner.log_step={STEPS},," \
            f"config.downstream_expert.datarc.batch_size=4"  # fmt: skip
    runs = []
    for name, upstream in (("ours", ["-u", "speechattn", "-k", str(upstream_pt)]),
                           ("fbank", ["-u", "fbank_no_cmvn"])):  # fmt: skip
        common = [*upstream, "-d", "speech_commands", "--quick", "-p", str(out / name)]
        runs.append(["-m", "train", *common, "--data", str(data), "-o", short])
        runs.append(["-m", "evaluate", *common])
    return runs


@pytest.mark.slow
def test_keyword_spotting_train_and_evaluate(tiny_corpus, pretrained_tiny_run, tmp_path):
    upstream_pt = pretrained_tiny_run / "upstream.pt"
    data = prepare("speech_commands", tiny_corpus, tmp_path / "ks", repeats=1)
    test_clips = sorted((data / "test").glob("*/*.wav"))
    assert {p.parent.name for p in test_clips} >= {"yes", "no", "_unknown_", "_silence_"}
    root = Path(speechattn.__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            *["|".join(c) for c in commands(upstream_pt, data, tmp_path)],
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    printed = [float(x) for x in re.findall(r"^test acc: ([\d.]+)$", done.stdout, re.M)]
    assert len(printed) == 2, done.stdout[-2000:]  # s3prl's own evaluation line, per upstream
    for name, s3prl_accuracy in zip(("ours", "fbank"), printed, strict=True):
        expdir = tmp_path / name
        assert (expdir / f"states-{STEPS}.ckpt").is_file()
        predictions = (expdir / "test_predict.txt").read_text().splitlines()
        assert len(predictions) == len(test_clips)  # every test clip scored
        result = read_superb(expdir / "superb_result.json")
        assert result.task == "speech_commands" and result.metric == "accuracy"
        assert result.split == "test" and result.quick and result.steps == STEPS
        assert result.value == pytest.approx(s3prl_accuracy, abs=1e-12)
        assert 0.0 <= result.value <= 1.0
    ours = read_superb(tmp_path / "ours" / "superb_result.json")
    assert ours.upstream == "speechattn" and ours.upstream_ckpt == str(upstream_pt)
    assert ours.selection == "weighted sum" and ours.expdir == str(tmp_path / "ours")
    assert ours.upstream_sha256 == hashlib.sha256(upstream_pt.read_bytes()).hexdigest()
    assert ours.attention == speechattn.load_upstream(upstream_pt).attention_name
    assert read_superb(tmp_path / "fbank" / "superb_result.json").attention == "fbank_no_cmvn"
    # the runner's checkpoint, read weights-only with the allow-list
    compat.install_checkpoints()
    state = torch.load(tmp_path / "ours" / f"states-{STEPS}.ckpt", weights_only=True)
    assert state["Args"].upstream == "speechattn" and state["Step"] == STEPS
    check_featurizer(upstream_pt, state["Featurizer"], test_clips[:6])
    # the command that prints them: the softmax of the trained weights, one per hidden state
    from speechattn.superb.weights import layer_weights

    shown = layer_weights(tmp_path / "ours")  # the folder: its dev-best or latest checkpoint
    expected = torch.softmax(state["Featurizer"]["weights"].float(), 0).tolist()
    assert shown == pytest.approx(expected) and sum(shown) == pytest.approx(1.0)


def check_featurizer(upstream_pt: Path, featurizer_state: dict, clips: list[Path]) -> None:
    """s3prl's Featurizer with the trained layer weights, on our expert, equals the same
    softmax-weighted sum of `load_upstream`'s hidden states (1 s clips: 33 frames both ways)."""
    from speechattn.interop.s3prl import UpstreamExpert

    expert = UpstreamExpert(upstream_pt)
    featurizer = interfaces.Featurizer(expert, upstream_device="cpu")
    featurizer.load_state_dict(featurizer_state)
    assert not torch.equal(featurizer.weights, torch.zeros_like(featurizer.weights))  # trained
    wavs = [compat.apply_effects_file(p, [["channels", "1"]])[0][0] for p in clips]
    with torch.no_grad():
        features = featurizer(wavs, expert(wavs))
    up = speechattn.load_upstream(upstream_pt)
    weights = torch.softmax(featurizer.weights.detach(), 0)
    for wav, feature in zip(wavs, features, strict=True):
        with torch.no_grad():
            feats, frames = up.features_from_waveforms(wav[None], torch.tensor([wav.numel()]))
            hidden = up(feats, frames).hidden_states
        mixed = sum(w * h[0] for w, h in zip(weights, hidden, strict=True))
        assert feature.shape == mixed.shape == (round(wav.numel() / 480), up.hidden_dim)
        torch.testing.assert_close(feature, mixed, rtol=1e-5, atol=1e-6)

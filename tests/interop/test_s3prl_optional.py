"""The s3prl expert without s3prl installed: importable, a plain nn.Module, same forward."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import speechattn

SCRIPT = """
import sys
sys.modules["s3prl"] = None  # as if s3prl were not installed: every import of it fails
import torch
from speechattn.interop.s3prl import S3PRL_AVAILABLE, UpstreamExpert
assert not S3PRL_AVAILABLE
assert UpstreamExpert.__mro__[1] is torch.nn.Module, UpstreamExpert.__mro__
expert = UpstreamExpert(sys.argv[1])
wav = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    out = expert([wav])
torch.save([h.contiguous() for h in out["hidden_states"]], sys.argv[3])
try:
    UpstreamExpert(sys.argv[1], hooks=[])
except TypeError as e:
    assert "need s3prl" in str(e), e
else:
    raise AssertionError("hook arguments accepted without s3prl")
print("ok", expert.get_downsample_rates("hidden_states"))
"""


@pytest.mark.slow
def test_expert_works_without_s3prl(pretrained_tiny_run: Path, tmp_path: Path):
    upstream = pretrained_tiny_run / "upstream.pt"
    wav = 0.1 * torch.randn(9000, generator=torch.Generator().manual_seed(2))
    torch.save(wav, tmp_path / "wav.pt")
    root = Path(speechattn.__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(upstream),
            str(tmp_path / "wav.pt"),
            str(tmp_path / "h.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "480"]
    hidden = torch.load(tmp_path / "h.pt", weights_only=True)
    up = speechattn.load_upstream(upstream)
    with torch.no_grad():
        feats, frames = up.features_from_waveforms(wav[None], torch.tensor([9000]))
        ref = up(feats, frames).hidden_states
    assert len(hidden) == len(ref) == 3
    # 9000 samples: 18 model frames, s3prl counts round(9000 / 480) = 19: the last repeats
    for a, b in zip(hidden, ref, strict=True):
        assert a.shape[1] == 19 and b.shape[1] == 18
        assert torch.equal(a[:, :18], b) and torch.equal(a[:, 18], b[:, 17])

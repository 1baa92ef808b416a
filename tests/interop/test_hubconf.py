"""`torch.hub.load(REPO_DIR, ..., source="local")` on a freshly pretrained upstream."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import speechattn

REPO_DIR = str(Path(__file__).resolve().parents[2])


def test_hub_upstream_equals_load_upstream(pretrained_tiny_run: Path):
    path = pretrained_tiny_run / "upstream.pt"
    up = torch.hub.load(REPO_DIR, "speechattn_upstream", source="local", ckpt=str(path))
    ref = speechattn.load_upstream(path)
    assert isinstance(up, speechattn.model.Upstream) and not up.training
    assert up.metadata == ref.metadata and up.attention_name == ref.attention_name
    wavs = 0.1 * torch.randn(2, 12000, generator=torch.Generator().manual_seed(1))
    wavs[1, 7000:] = 0
    lengths = torch.tensor([12000, 7000])
    with torch.no_grad():
        feats, frames = ref.features_from_waveforms(wavs, lengths)
        out = up(feats, frames)
        got, want = out.hidden_states, ref(feats, frames).hidden_states
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert a.shape == (2, 25, 32)
        assert torch.equal(a, b)
    assert torch.equal(out.last_hidden_state, want[-1])

    expert = torch.hub.load(REPO_DIR, "speechattn_s3prl", source="local", ckpt=str(path))
    with torch.no_grad():
        hidden = expert([wavs[0], wavs[1, :7000]])["hidden_states"]
    assert expert.get_downsample_rates("hidden_states") == 480
    assert not any(m.training for m in expert.modules())  # eval mode, like the upstream
    # 7000 samples: the model gives 14 frames, s3prl counts round(7000 / 480) = 15, so the
    # expert repeats the last one (the length rule of speechattn.interop.s3prl)
    for a, b in zip(hidden, want, strict=True):
        assert a.shape == (2, 25, 32)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1, :14], b[1, :14])
        assert torch.equal(a[1, 14], b[1, 13]) and (a[1, 15:] == 0).all()


def test_hub_loads_the_runs_upstream_folder_as_its_upstream_pt(pretrained_tiny_run: Path):
    folder = str(pretrained_tiny_run / "upstream")  # the safetensors folder beside upstream.pt
    up = torch.hub.load(REPO_DIR, "speechattn_upstream", source="local", ckpt=folder)
    ref = speechattn.load_upstream(pretrained_tiny_run / "upstream.pt")
    for (k, a), (_, b) in zip(up.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    expert = torch.hub.load(REPO_DIR, "speechattn_s3prl", source="local", ckpt=folder)
    wav = 0.1 * torch.randn(9000, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats, frames = ref.features_from_waveforms([wav])
        got, want = expert([wav])["hidden_states"], ref(feats, frames).hidden_states
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[:, : b.shape[1]], b)


def test_hub_without_ckpt_says_what_is_needed(tmp_path):
    with pytest.raises(ValueError, match="need ckpt=PATH"):
        torch.hub.load(REPO_DIR, "speechattn_upstream", source="local")
    with pytest.raises(FileNotFoundError, match="nothing.pt"):
        torch.hub.load(
            REPO_DIR, "speechattn_upstream", source="local", ckpt=str(tmp_path / "nothing.pt")
        )

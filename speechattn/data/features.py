"""Log-mel features, normalisation, and the 10 ms <-> model-frame helpers (docs/data.md).

Shapes: B batch, T 10 ms frames, F feature dim (80, or 240 with deltas), T' model frames
(T' = ceil(T / factor)), D model dim.

Framing follows Kaldi snip-edges (torchaudio `center=False`): 25 ms windows every 10 ms give
`num_frames(n) = (n - 400) // 160 + 1` frames, exactly one per CPC phone label.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from speechattn.errors import ConfigError, SpeechattnError
from speechattn.utils import lengths_to_padding_mask

FEATURE_VERSION = 1  # bump when extraction changes: feature caches are keyed on it
SAMPLE_RATE = 16000
WIN_LENGTH = 400  # 25 ms
HOP_LENGTH = 160  # 10 ms


def num_frames(num_samples: int) -> int:
    """Kaldi snip-edges frame count at 16 kHz; 0 when shorter than one window."""
    return max(0, (num_samples - WIN_LENGTH) // HOP_LENGTH + 1)


def min_samples_for(frames: int) -> int:
    """Fewest samples that give `frames` frames."""
    return WIN_LENGTH + (frames - 1) * HOP_LENGTH if frames > 0 else 0


class LabelMismatchError(SpeechattnError, ValueError):
    """An utterance's frame labels do not fit its frames (beyond data.label_tolerance)."""


@dataclass(frozen=True)
class FeatureConfig:
    """Log-mel settings (everything that changes the cached numbers)."""

    n_mels: int = 80
    n_fft: int = 400
    win_length: int = WIN_LENGTH
    hop_length: int = HOP_LENGTH
    f_min: float = 20.0
    f_max: float = 7600.0
    log_offset: float = 1e-6  # log(mel power + offset): keeps digital silence finite
    deltas: bool = False  # append deltas and delta-deltas (window 5)

    @property
    def dim(self) -> int:
        return self.n_mels * (3 if self.deltas else 1)

    def to_dict(self) -> dict[str, Any]:
        """Constructor arguments: `FeatureConfig(**cfg.to_dict()) == cfg` (stored in upstream.pt)."""
        return asdict(self)

    def fingerprint(self) -> dict[str, Any]:
        return {"feature_version": FEATURE_VERSION, **asdict(self)}


class LogMel:
    """Waveform (N,) float32 at 16 kHz -> log-mel (T, F) float32, T = num_frames(N)."""

    def __init__(self, cfg: FeatureConfig = FeatureConfig()) -> None:
        import torchaudio

        self.cfg = cfg
        # center=False: snip-edges, so the frame count matches the 10 ms labels
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=SAMPLE_RATE,
            n_fft=cfg.n_fft,
            win_length=cfg.win_length,
            hop_length=cfg.hop_length,
            f_min=cfg.f_min,
            f_max=cfg.f_max,
            n_mels=cfg.n_mels,
            center=False,
            power=2.0,
        )

    @torch.no_grad()
    def __call__(self, wav: Tensor | np.ndarray) -> Tensor:
        wav = torch.as_tensor(wav, dtype=torch.float32)
        if self.mel.spectrogram.window.device != wav.device:
            self.mel = self.mel.to(wav.device)
        if wav.dim() != 1:
            raise ValueError(f"expected a mono waveform (N,), found shape {tuple(wav.shape)}")
        if wav.numel() < self.cfg.win_length:
            return torch.zeros(0, self.cfg.dim)
        spec = torch.log(self.mel(wav) + self.cfg.log_offset)  # (n_mels, T)
        if self.cfg.deltas:
            import torchaudio.functional as AF

            d1 = AF.compute_deltas(spec[None], win_length=5)[0]
            d2 = AF.compute_deltas(d1[None], win_length=5)[0]
            spec = torch.cat([spec, d1, d2], dim=0)  # (3 n_mels, T)
        return spec.T.contiguous()  # (T, F)


cached_log_mel = functools.cache(LogMel)  # this process's `LogMel` of a config, built once


def log_mel_batch(
    wavs: Tensor, lengths: Tensor, cfg: FeatureConfig = FeatureConfig()
) -> tuple[Tensor, Tensor]:
    """Unnormalised log-mel of a padded batch, as the feature cache computes it (theirs differ
    by float16 rounding only): wavs (B, S) 16 kHz, lengths (B,) samples -> features (B, T, F)
    zero past each utterance's frames, frames (B,) = num_frames(lengths)."""
    mel = cached_log_mel(cfg)
    frames = torch.tensor([num_frames(int(n)) for n in lengths], dtype=torch.long)
    out = wavs.new_zeros(wavs.shape[0], int(frames.max()) if len(frames) else 0, cfg.dim)
    for b in range(wavs.shape[0]):
        if frames[b] > 0:
            out[b, : frames[b]] = mel(wavs[b, : int(lengths[b])].float()).to(out)
    return out, frames.to(wavs.device)


class Normalizer:
    """Feature normalisation: "global" (x - mean) / std with `mean`, `std` (F,) from the
    training split, "utterance" CMVN over the valid frames (erases speaker information), or
    "none". `__call__(features (..., T, F), lengths (B,) | None)`: zero past `lengths`.
    """

    MODES = ("global", "utterance", "none")

    def __init__(self, mean: Tensor, std: Tensor, mode: str = "global") -> None:
        if mode not in self.MODES:
            raise ConfigError(f"normalisation mode must be one of {self.MODES}, found {mode!r}")
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)  # (F,)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)  # (F,)
        if self.mean.shape != self.std.shape:
            shapes = f"mean {tuple(self.mean.shape)} and std {tuple(self.std.shape)}"
            raise ValueError(f"{shapes} differ")
        self.mode = mode
        self._np = (self.mean.cpu().numpy().copy(), (1.0 / self.std).cpu().numpy())  # for `numpy`

    @classmethod
    def from_sums(
        cls, count: int, total: np.ndarray, total_sq: np.ndarray, mode: str = "global"
    ) -> Normalizer:
        """From frame count and per-dimension sum and sum of squares (float64 (F,))."""
        if count <= 0:
            raise ConfigError("cannot compute normalisation statistics from 0 frames")
        mean = total / count
        var = np.maximum(total_sq / count - mean**2, 0.0)
        std = np.sqrt(np.maximum(var, 1e-10))
        return cls(torch.from_numpy(mean).float(), torch.from_numpy(std).float(), mode)

    @classmethod
    def identity(cls, dim: int) -> Normalizer:
        return cls(torch.zeros(dim), torch.ones(dim), "none")

    @property
    def dim(self) -> int:
        return self.mean.numel()

    def __call__(self, features: Tensor, lengths: Tensor | None = None) -> Tensor:
        if features.size(-1) != self.dim:
            raise ValueError(f"features have {features.size(-1)} dims, the normaliser {self.dim}")
        valid = _valid_mask(features, lengths)  # (..., T, 1) bool or None
        if self.mode == "global":
            out = (features - self.mean.to(features)) / self.std.to(features)
        elif self.mode == "utterance":
            out = cmvn(features, lengths)
        else:
            out = features.clone()
        return out if valid is None else out.masked_fill(~valid, 0.0)

    def numpy(self, x: np.ndarray) -> np.ndarray:
        """Normalise one utterance (T, F) of any float dtype -> new float32 array (the loaders'
        path: single-threaded NumPy, as torch's intra-op threads cost 10x on a busy CPU)."""
        mean, inv_std = self._np
        if self.mode == "global":
            out = np.subtract(x, mean, dtype=np.float32)  # cast and centre in one pass
            out *= inv_std
            return out
        out = np.asarray(x, dtype=np.float32).copy()
        if self.mode == "utterance" and len(out):
            out -= out.mean(0)
            out /= out.std(0) + 1e-5
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.clone(), "std": self.std.clone(), "mode": self.mode}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Normalizer:
        return cls(state["mean"], state["std"], state.get("mode", "global"))

    def __repr__(self) -> str:
        return f"Normalizer(mode={self.mode!r}, dim={self.dim})"


def _valid_mask(features: Tensor, lengths: Tensor | None) -> Tensor | None:
    if lengths is None:
        return None
    return ~lengths_to_padding_mask(lengths.to(features.device), features.size(-2))[..., None]


def cmvn(features: Tensor, lengths: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Per-utterance mean/variance normalisation over valid frames of (T, F) or (B, T, F)."""
    if features.dim() == 2:
        mean, std = features.mean(0, keepdim=True), features.std(0, unbiased=False, keepdim=True)
        return (features - mean) / (std + eps)
    valid = _valid_mask(features, lengths)
    if valid is None:
        valid = torch.ones_like(features[..., :1], dtype=torch.bool)
    w = valid.to(features.dtype)  # (B, T, 1)
    n = w.sum(1, keepdim=True).clamp_min(1.0)  # (B, 1, 1)
    mean = (features * w).sum(1, keepdim=True) / n  # (B, 1, F)
    var = (((features - mean) * w) ** 2).sum(1, keepdim=True) / n
    return (features - mean) / (var.sqrt() + eps)


def stack_frames(
    x: Tensor, lengths: Tensor, factor: int = 3, frames: int | None = None
) -> tuple[Tensor, Tensor]:
    """Stack `factor` consecutive 10 ms frames into one model frame (AALBERT input): x (B, T, F),
    lengths (B,) -> (B, T', factor * F) zero past each length (a partial last model frame
    zero-filled), lengths ceil(lengths / factor). `frames`: T' (>= ceil(T / factor), the
    default), so a caller that pads to a length bucket gets it in the same copy.
    """
    B, T, F = x.shape
    T_pad = max(-(-T // factor), frames or 0) * factor
    x = torch.nn.functional.pad(x, (0, 0, 0, T_pad - T)) if T_pad != T else x.clone()
    on_host = x.device.type == lengths.device.type == "cpu"
    if on_host and not torch.compiler.is_compiling():
        for b, n in enumerate(lengths.tolist()):  # the loader's case: touch the padding only
            x[b, n:] = 0.0
    else:  # lengths on a GPU are not read on the host
        x.masked_fill_(lengths_to_padding_mask(lengths.to(x.device), T_pad)[..., None], 0.0)
    stacked = x.reshape(B, T_pad // factor, factor * F)  # (B, T', factor*F)
    return stacked, torch.div(lengths + factor - 1, factor, rounding_mode="floor")


def expand_to_labels(
    h: Tensor,
    factor: int,
    label_lengths: Tensor,
    utt_ids: list[str],
    tolerance: int = 2,
    lengths: Tensor | None = None,
) -> Tensor:
    """Repeat each model frame `factor` times and trim/pad to each utterance's label length:
    h (B, T', D), label_lengths (B,), lengths (B,) valid model frames (None: all T') ->
    (B, max(label_lengths), D), zero past each label length. Label frame t of utterance b takes
    model frame min(t // factor, lengths[b] - 1). `LabelMismatchError` when the labels outrun
    the repeated frames by more than `tolerance`, or (with `lengths`) fall short by more than
    `factor - 1 + tolerance` (`stack_frames`' ceil adds up to `factor - 1`).
    """
    B, T_model, D = h.shape
    label_lengths = label_lengths.to(h.device).long()
    given = lengths is not None
    lengths = (lengths if given else torch.full((B,), T_model)).to(h.device).long()
    expanded = lengths * factor  # (B,) 10 ms frames covered by the model frames
    bad = label_lengths > expanded + tolerance
    if given:
        bad |= label_lengths < expanded - (factor - 1) - tolerance
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise LabelMismatchError(
            f"utterance {utt_ids[b]}: {int(label_lengths[b])} labels but {int(lengths[b])} model frames "
            f"x {factor} = {int(expanded[b])} frames (tolerance {tolerance} frames): check that "
            f"data.alignments belongs to this audio, or allow more with data.label_tolerance"
        )
    T_lab = int(label_lengths.max()) if B else 0
    if T_model == 0:
        return h.new_zeros(B, T_lab, D)
    t = torch.arange(T_lab, device=h.device)  # (T_lab,)
    idx = torch.minimum(t[None, :] // factor, (lengths - 1).clamp_min(0)[:, None])  # (B, T_lab)
    out = torch.gather(h, 1, idx[..., None].expand(B, T_lab, D))  # (B, T_lab, D)
    valid = t[None, :] < label_lengths[:, None]  # (B, T_lab)
    return out.masked_fill(~valid[..., None], 0.0)

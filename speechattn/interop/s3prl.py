"""A speechattn upstream (`upstream.pt` or upstream folder) as an s3prl (0.4.x) upstream
("expert"); usage in docs/upstream.md, the frame-length rule in docs/superb.md. With s3prl
installed it subclasses s3prl's `UpstreamBase` (hooks, `Featurizer`), else it is a plain
`nn.Module` with the same forward.

Shapes: B utterances, S samples at 16 kHz, T' model frames (30 ms), D model dim, L layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from speechattn.data.features import SAMPLE_RATE
from speechattn.errors import ConfigError
from speechattn.model.upstream import (
    MAX_ABS_AMPLITUDE,
    Upstream,
    WaveformError,
    load_upstream,
    pad_waveforms,
)

try:  # optional: the expert only needs s3prl for its hooks; its interface module is light
    from s3prl.upstream.interfaces import UpstreamBase as _ExpertBase

    S3PRL_AVAILABLE = True
except ImportError:
    _ExpertBase = nn.Module
    S3PRL_AVAILABLE = False


def s3prl_frames(num_samples: int, samples_per_frame: int = 480) -> int:
    """Frames s3prl's `Featurizer.tolist` keeps of a `num_samples` utterance (half to even)."""
    return round(num_samples / samples_per_frame)


def match_s3prl_lengths(
    hidden: list[Tensor], model_frames: Tensor, samples: Tensor, samples_per_frame: int
) -> list[Tensor]:
    """Hidden states padded (last frame repeated) or trimmed to the frame counts s3prl's
    `Featurizer` assumes, zero past them: hidden L+1 tensors (B, T', D), model_frames (B,) >= 1,
    samples (B,) -> L+1 tensors (B, T_s, D), T_s = max_b round(S_b / samples_per_frame)."""
    target = torch.tensor(
        [s3prl_frames(int(n), samples_per_frame) for n in samples.tolist()],
        device=model_frames.device,
    )  # (B,)
    steps = torch.arange(int(target.max()), device=model_frames.device)  # (T_s,)
    index = torch.minimum(steps[None, :], model_frames[:, None] - 1)  # (B, T_s) last-frame repeat
    keep = (steps[None, :] < target[:, None]).unsqueeze(-1)  # (B, T_s, 1)
    gather = index.unsqueeze(-1)  # (B, T_s, 1), expanded to each hidden state's D
    return [h.gather(1, gather.expand(-1, -1, h.shape[-1])) * keep for h in hidden]


class UpstreamExpert(_ExpertBase):
    """s3prl upstream over a speechattn `upstream.pt` or upstream folder (s3prl's `-k`); s3prl's
    `-g` (model_config) must stay unset and `refresh` has no effect, as nothing is downloaded;
    **kwargs go to s3prl's `UpstreamBase` (`hooks`, `hook_postprocess`)."""

    def __init__(
        self,
        ckpt: str | Path | None = None,
        model_config: str | None = None,
        refresh: bool = False,
        map_location: str | torch.device = "cpu",
        **kwargs: Any,
    ) -> None:
        if kwargs and not S3PRL_AVAILABLE:
            raise TypeError(
                f"UpstreamExpert got {sorted(kwargs)}: s3prl hook arguments need s3prl "
                f"(pip install 'speechattn[s3prl]')"
            )
        super().__init__(**kwargs)
        if ckpt is None or str(ckpt) == "":
            raise ConfigError(
                "UpstreamExpert needs ckpt=PATH of a speechattn upstream.pt or upstream folder "
                "(run_downstream.py -k PATH)"
            )
        if model_config:
            raise ConfigError(
                f"model_config={model_config!r}: a speechattn upstream.pt carries its own model "
                f"config; drop -g/--upstream_model_config"
            )
        self.name = "[speechattn UpstreamExpert]"
        self.upstream: Upstream = load_upstream(ckpt, map_location=map_location)
        self.ckpt = str(ckpt)
        self.eval()  # like load_upstream: a frozen feature extractor until asked to train

    def get_downsample_rates(self, key: str) -> int:
        """16 kHz samples per output frame for every key: 10 ms hop x 3 stacked frames = 480."""
        return self.upstream.samples_per_frame

    def forward(
        self, wavs: list[Tensor], sample_rate: int = SAMPLE_RATE
    ) -> dict[str, Tensor | list[Tensor]]:
        """wavs: B 1-D 16 kHz waveforms (S_b,) -> {"hidden_states": L+1 tensors (B, T', D),
        "last_hidden_state": (B, T', D)}, round(S_b / 480) frames per utterance, zero after;
        {} when s3prl hooks are registered (s3prl builds those keys from them)."""
        if sample_rate != SAMPLE_RATE:
            raise WaveformError(
                f"{self.name} got {sample_rate} Hz audio; the upstream was trained on "
                f"{SAMPLE_RATE} Hz log-mel: resample to {SAMPLE_RATE} Hz first"
            )
        padded, lengths = pad_waveforms(wavs, self.upstream.mean.device)
        features, frames = self.upstream.features_from_waveforms(padded, lengths)
        out = self.upstream(features, frames)  # s3prl's hooks, if any, fire in this call
        if getattr(self, "hooks", None):
            return {}
        hidden = match_s3prl_lengths(
            list(out.hidden_states), out.output_lengths, lengths, self.upstream.samples_per_frame
        )  # L+1 tensors (B, T_s, D)
        return {"hidden_states": hidden, "last_hidden_state": hidden[-1]}


def speechattn_local(ckpt: str | Path, *args: Any, **kwargs: Any) -> UpstreamExpert:
    """s3prl hub entry: `run_downstream.py -u speechattn_local -k path/to/upstream.pt`."""
    return UpstreamExpert(ckpt, *args, **kwargs)


__all__ = [
    "MAX_ABS_AMPLITUDE",
    "S3PRL_AVAILABLE",
    "UpstreamExpert",
    "WaveformError",
    "match_s3prl_lengths",
    "s3prl_frames",
    "speechattn_local",
]

"""In-process shims that let unmodified s3prl 0.4.18 `run_downstream.py` run on torch and
torchaudio 2.11, current huggingface_hub and Python 3.11 (docs/superb.md#compatibility-shims).
`install()` bridges each gap of `SHIMS` only where it exists; `set_voxceleb1_cache` is one more,
per experiment.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import soundfile as sf
import torch
import torchaudio
from torch import Tensor

from speechattn.data.errors import DataError
from speechattn.errors import SpeechattnError

log = logging.getLogger(__name__)


class ShimError(SpeechattnError, NotImplementedError):
    """s3prl asked a shim for something it does not bridge; the message names the way out."""


@dataclass(frozen=True)
class Shim:
    """One bridge: what it bridges (s3prl caller, the release that removed the API), installer."""

    name: str
    bridges: str
    install: Callable[[], bool]


def _imports(name: str, errors: type[Exception] = ImportError) -> bool:
    """Whether module `name` imports here (`errors`: the failures that mean it does not)."""
    try:
        importlib.import_module(name)
    except errors:
        return False
    return True


def _register(name: str, doc: str, **attrs: Any) -> types.ModuleType:
    """A module `name` holding `attrs`, registered in `sys.modules` (so imports find it)."""
    module = types.ModuleType(name, f"speechattn shim: {doc} (see speechattn.superb.compat)")
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def install_set_audio_backend() -> bool:
    if hasattr(torchaudio, "set_audio_backend"):
        return False
    # torchaudio < 2.9's backend switch; audio I/O has one backend now, so nothing to do
    torchaudio.set_audio_backend = lambda backend=None: None
    return True


def _read(path: str | Path, frame_offset: int = 0, num_frames: int = -1) -> tuple[Tensor, int]:
    """Audio file -> float32 (C, N) in [-1, 1] and its sample rate, read by soundfile."""
    try:
        data, rate = sf.read(
            str(path), start=frame_offset, frames=num_frames, dtype="float32", always_2d=True
        )
    except (sf.LibsndfileError, RuntimeError) as e:
        raise DataError(Path(path), "unreadable audio", str(e)) from e
    return torch.from_numpy(data.T.copy()), int(rate)


def _apply_effects(
    wav: Tensor, rate: int, effects: list[list[str]], where: str
) -> tuple[Tensor, int]:
    """sox effects on (C, N) float audio: ["channels", "1"] (mean of the channels, as sox mixes
    down), ["rate", R] (torchaudio's band-limited resampling), ["gain", dB]; others raise."""
    for effect in effects:
        name, *values = [str(v) for v in effect]
        if name == "channels" and values == ["1"]:
            wav = wav.mean(0, keepdim=True)
        elif name == "rate" and len(values) == 1:
            target = int(float(values[0]))
            if target != rate:
                wav = torchaudio.functional.resample(wav, rate, target)
                rate = target
        elif name == "gain" and len(values) == 1:
            wav = wav * 10 ** (float(values[0]) / 20)
        else:
            raise ShimError(
                f"sox effect {effect!r} on {where}: the speechattn sox_effects shim (torchaudio "
                f"2.9 removed sox) applies only channels 1, rate R and gain dB"
            )
    return wav, rate


def apply_effects_file(
    path: str | Path,
    effects: list[list[str]],
    normalize: bool = True,
    channels_first: bool = True,
    format: str | None = None,
) -> tuple[Tensor, int]:
    """torchaudio.sox_effects.apply_effects_file for the effects of `_apply_effects`: float32
    (C, N) (or (N, C)) in [-1, 1] whatever `normalize`, and the sample rate."""
    wav, rate = _apply_effects(*_read(path), effects, str(path))
    return (wav if channels_first else wav.T), rate


def apply_effects_tensor(
    tensor: Tensor, sample_rate: int, effects: list[list[str]], channels_first: bool = True
) -> tuple[Tensor, int]:
    """torchaudio.sox_effects.apply_effects_tensor for the same effects."""
    wav = tensor if channels_first else tensor.T
    wav, rate = _apply_effects(wav.float(), sample_rate, effects, "a tensor")
    return (wav if channels_first else wav.T), rate


def install_sox_effects() -> bool:
    if _imports("torchaudio.sox_effects"):
        return False
    torchaudio.sox_effects = _register(
        "torchaudio.sox_effects",
        "torchaudio 2.9 removed sox_effects",
        apply_effects_file=apply_effects_file,
        apply_effects_tensor=apply_effects_tensor,
    )
    return True


def load(
    uri: str | Path,
    frame_offset: int = 0,
    num_frames: int = -1,
    normalize: bool = True,
    channels_first: bool = True,
    format: str | None = None,
    buffer_size: int = 4096,
    backend: str | None = None,
) -> tuple[Tensor, int]:
    """torchaudio.load through soundfile: float32 (C, N) (or (N, C)) in [-1, 1], sample rate;
    `normalize=False` (integer samples) is not offered: s3prl never asks for it."""
    if not normalize:
        raise ShimError(f"torchaudio.load({uri}, normalize=False): the soundfile shim reads floats")
    wav, rate = _read(uri, frame_offset, num_frames)
    return (wav if channels_first else wav.T), rate


@dataclass(frozen=True)
class AudioMetaData:
    """torchaudio's `info()` result, the fields s3prl reads."""

    sample_rate: int
    num_frames: int
    num_channels: int
    bits_per_sample: int
    encoding: str


def info(uri: str | Path, format: str | None = None, backend: str | None = None) -> AudioMetaData:
    """torchaudio.info through soundfile's header read."""
    header = sf.info(str(uri))
    bits = {"PCM_16": 16, "PCM_24": 24, "PCM_32": 32, "PCM_U8": 8, "FLOAT": 32, "DOUBLE": 64}
    return AudioMetaData(
        sample_rate=int(header.samplerate),
        num_frames=int(header.frames),
        num_channels=int(header.channels),
        bits_per_sample=bits.get(header.subtype, 0),
        encoding=header.subtype,
    )


def install_audio_io() -> bool:
    # torchcodec imports, then loads FFmpeg: any failure means torchaudio.load cannot work
    if torchaudio.load is load or _imports("torchcodec.decoders", Exception):
        return False
    torchaudio.load = load
    torchaudio.info = info
    return True


class _HubRemoved:
    """Names s3prl imports from huggingface_hub < 1.0 for --push_to_hf_hub and --hub
    huggingface only, which `speechattn.superb` refuses; using them raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._refuse()

    @classmethod
    def _refuse(cls, *args: Any, **kwargs: Any) -> None:
        raise ShimError(
            f"huggingface_hub.{cls.__name__} (removed in huggingface_hub 1.0) is needed only to "
            f"push to the Hugging Face Hub; drop --push_to_hf_hub / --hub huggingface"
        )

    get_token = save_token = delete_token = _refuse


def install_hf_folder() -> bool:
    import huggingface_hub

    missing = [name for name in ("HfFolder", "Repository") if not hasattr(huggingface_hub, name)]
    for name in missing:
        setattr(huggingface_hub, name, type(name, (_HubRemoved,), {}))
    return bool(missing)


class DistributedSamplerWrapper(torch.utils.data.DistributedSampler):
    """catalyst's class of this name: the wrapped sampler is drawn once per epoch (alike on
    every rank, as runs seed every rank alike) and rank r keeps positions r, r + world, ..."""

    def __init__(
        self,
        sampler: torch.utils.data.Sampler,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
    ) -> None:
        super().__init__(list(range(len(sampler))), num_replicas, rank, shuffle)  # type: ignore[arg-type]
        self.sampler = sampler

    def __iter__(self):
        drawn = list(iter(self.sampler))
        return iter([drawn[p] for p in super().__iter__()])  # this rank's share, padded evenly


def install_catalyst() -> bool:
    # not installed, or installed and broken on Python 3.11
    if _imports("catalyst.data.sampler", Exception):
        return False
    for name in [n for n in sys.modules if n == "catalyst" or n.startswith("catalyst.")]:
        del sys.modules[name]  # a half-imported broken catalyst
    doc = "s3prl 0.4.18's speech_commands expert imports catalyst"
    sampler = _register(
        "catalyst.data.sampler", doc, DistributedSamplerWrapper=DistributedSamplerWrapper
    )
    _register("catalyst", doc, data=_register("catalyst.data", doc, sampler=sampler))
    return True


def install_checkpoints() -> bool:
    # a runner checkpoint's parsed command line (`Args`), allowed in weights-only loading
    if argparse.Namespace in torch.serialization.get_safe_globals():
        return False
    torch.serialization.add_safe_globals([argparse.Namespace])
    return True


def install_libriphone() -> bool:
    if _imports("s3prl.downstream.ctc.corpus.libriphone"):
        return False
    from speechattn.superb import libriphone

    # a package (`__path__`), so `from .corpus.libriphone import ...` resolves
    doc = "the s3prl 0.4.18 wheel ships no ctc/corpus package"
    _register("s3prl.downstream.ctc.corpus", doc, __path__=[], libriphone=libriphone)
    sys.modules["s3prl.downstream.ctc.corpus.libriphone"] = libriphone
    return True


def set_voxceleb1_cache(expdir: str | Path) -> Path:
    """Point s3prl's voxceleb1 file-list cache (inside site-packages by default, shared by every
    data set: a second one would train on the first one's files) at `expdir/.voxceleb1_cache/`."""
    dataset = importlib.import_module("s3prl.downstream.voxceleb1.dataset")
    folder = Path(expdir) / ".voxceleb1_cache"
    dataset.CACHE_PATH = str(folder) + "/"  # s3prl joins it with os.path.join
    return folder


SHIMS: tuple[Shim, ...] = (
    Shim(
        "set_audio_backend",
        "torchaudio 2.9 removed set_audio_backend (s3prl 0.4.18 "
        "run_downstream.main, upstream/byol_s)",
        install_set_audio_backend,
    ),
    Shim(
        "sox_effects",
        "torchaudio 2.9 removed sox_effects (s3prl 0.4.18 speech_commands "
        "dataset, mos_prediction import)",
        install_sox_effects,
    ),
    Shim(
        "audio_io",
        "torchaudio 2.9 routes load/info through torchcodec + FFmpeg (s3prl "
        "0.4.18 voxceleb1 and ctc datasets)",
        install_audio_io,
    ),
    Shim(
        "hf_folder",
        "huggingface_hub 1.0 removed HfFolder and Repository (s3prl 0.4.18 "
        "runner.py and run_downstream.py imports)",
        install_hf_folder,
    ),
    Shim(
        "catalyst",
        "no catalyst release installs and imports on Python 3.11 (s3prl 0.4.18 "
        "speech_commands expert)",
        install_catalyst,
    ),
    Shim(
        "checkpoints",
        "torch 2.6 made torch.load weights-only (s3prl 0.4.18 runner "
        "checkpoints hold argparse.Namespace)",
        install_checkpoints,
    ),
    Shim(
        "libriphone",
        "the s3prl 0.4.18 wheel lacks downstream/ctc/corpus (phoneme recognition)",
        install_libriphone,
    ),
)


def install() -> list[str]:
    """Install every shim that is needed here (idempotent); returns the names installed."""
    installed = [shim.name for shim in SHIMS if shim.install()]
    if installed:
        log.info("s3prl 0.4.18 compatibility shims installed: %s", ", ".join(installed))
    return installed

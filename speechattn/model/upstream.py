"""The pretrained upstream: `upstream.pt` and upstream folder formats, saving and
`load_upstream` (format, versions, errors and outputs: docs/upstream.md).

`upstream.pt` is a dict of tensors and plain values (format, version, model_config, state_dict,
normalizer {mean, std, mode}, feature_config, metadata), read with `weights_only=True`; an
upstream folder holds the same as config.json + model.safetensors (no pickle). Both load to the
same module, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from speechattn.data.cache import file_sha256
from speechattn.data.features import (
    SAMPLE_RATE,
    WIN_LENGTH,
    FeatureConfig,
    Normalizer,
    log_mel_batch,
)
from speechattn.errors import ConfigError, OutputExistsError, SpeechattnError
from speechattn.model.aalbert import AALBERT, ModelConfig, padding_mask_for
from speechattn.model.serialization import (
    TorchFileError,
    check_is_file,
    describe_load_error,
    load_torch_file,
)
from speechattn.utils import atomic_folder, atomic_path, atomic_write_bytes, plain

UPSTREAM_FORMAT = "speechattn-upstream"
UPSTREAM_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
_LSH = ("sign_alsh", "xbox", "xbox_qnf", "simple_lsh", "simple_alsh")
# Attention options whose default changed with a format version (2: LSH's normalised keys and
# score tie-break, routing's uncapped clusters; 3: LSH hashes the keys it scores, with each
# scheme's own hash): {version: {variant: earlier values}}, which an older file gets where it
# does not state them, so that it keeps the definitions it was trained with.
EARLIER_OPTIONS: dict[int, dict[str, dict[str, object]]] = {
    2: {
        **dict.fromkeys(_LSH, {"normalize_keys": False, "tie_break": "position"}),
        "routing": {"max_clusters": 32},
    },
    3: dict.fromkeys(_LSH, {"hash": "sign", "hash_keys": "shared"}),
}
MEL_FRAME_RATE = 100.0  # 10 ms hop of the data layer's log-mel features
CONFIG_FILE = "config.json"  # an upstream folder's settings (Hugging Face's name)
WEIGHTS_FILE = "model.safetensors"  # its tensors (Hugging Face's name)
UPSTREAM_FOLDER = "upstream"  # a pretraining run's upstream folder, beside its upstream.pt
NORMALIZER_PREFIX = "normalizer."  # model.safetensors' keys of the normaliser's mean and std
# what speechattn writes into an upstream folder: a folder holding only these may be replaced
FOLDER_FILES = (CONFIG_FILE, WEIGHTS_FILE, "README.md", "loss_curve.png")


class UpstreamFileError(TorchFileError):
    """The file is missing, unreadable, corrupt or not a speechattn upstream."""


@dataclass
class UpstreamOutput:
    """What `Upstream.forward` returns, named and ordered as `transformers`'
    `Wav2Vec2BaseModelOutput` (plus our `output_lengths`), indexed by field name only:

        last_hidden_state: (B, T', D), equal to hidden_states[-1]
        extract_features:  (B, T', stack*F) stacked normalised log-mel, the encoder's input
        hidden_states:     L+1 tensors (B, T', D), the input embedding first
        attentions:        L tensors (B, h, T', T') with output_attentions=True, else None
        output_lengths:    (B,) valid model frames per utterance
    """

    last_hidden_state: Tensor
    extract_features: Tensor
    hidden_states: tuple[Tensor, ...]
    attentions: tuple[Tensor, ...] | None
    output_lengths: Tensor

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str) or key not in self.keys():
            hint = f"; index the layers as out.hidden_states[{key}]" if isinstance(key, int) else ""
            raise KeyError(f"UpstreamOutput has no field {key!r}; fields: {self.keys()}{hint}")
        return getattr(self, key)

    def keys(self) -> list[str]:
        """Names of the fields that are set (attentions only when requested), in order."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def to_tuple(self) -> tuple[Any, ...]:
        """The set fields in order, as HF's `return_dict=False` tuple."""
        return tuple(getattr(self, k) for k in self.keys())


class Upstream(nn.Module):
    """A frozen-ready AALBERT with its normalisation statistics and feature settings."""

    def __init__(
        self,
        model: AALBERT,
        normalizer: Normalizer,
        feature_config: dict[str, Any],
        metadata: dict[str, Any],
        source: str | None = None,
    ) -> None:
        super().__init__()
        self.source = source  # the file it was loaded from, for error messages
        self.model = model
        self.normalizer = normalizer  # training-split statistics, applied to raw log-mel
        self.register_buffer("mean", normalizer.mean.detach().clone().float())  # (F,)
        self.register_buffer("std", normalizer.std.detach().clone().float())  # (F,)
        self.feature_config = dict(feature_config)
        self.metadata = dict(metadata)
        c = model.config
        self.downsample = c.stack  # 10 ms frames per hidden state
        hop = FeatureConfig(**self.feature_config).hop_length  # samples per 10 ms frame
        self.samples_per_frame = hop * c.stack  # 16 kHz samples per hidden state (480)
        self.frame_rate = MEL_FRAME_RATE / c.stack  # hidden states per second (100/3)
        self.hidden_dim = c.dim
        self.num_layers = c.num_layers
        self.num_heads = c.num_heads
        self.feature_dim = c.feature_dim
        self.attention_name = c.attention

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def forward(
        self,
        features: Tensor,
        lengths: Tensor,
        head_mask: Tensor | None = None,
        *,
        output_attentions: bool = False,
    ) -> UpstreamOutput:
        """features (B, T, F) normalised log-mel, lengths (B,), head_mask (L, h) or None ->
        `UpstreamOutput` (shapes there), T' = ceil(T / downsample), zero at padded positions.
        `output_attentions=True` runs each variant's dense reference (hidden states then equal
        the plain call's to rounding, at O(T'^2) memory per layer)."""
        stacked, out_lengths = self.model.stack(features, lengths)  # (B, T', stack*F), (B,)
        layers = self.model.encoder.layers
        if output_attentions and not all(layer.attention.supports_weights for layer in layers):
            raise ConfigError(
                f"output_attentions=True: attention {self.attention_name!r} cannot return "
                f"attention weights (it has no dense reference); call without it"
            )
        padding_mask = padding_mask_for(out_lengths, stacked)
        hidden, weights = self.model.encode_with_weights(
            stacked, padding_mask, head_mask, weights_from=1 if output_attentions else None
        )
        return UpstreamOutput(
            last_hidden_state=hidden[-1],
            extract_features=stacked,
            hidden_states=tuple(hidden),
            attentions=tuple(weights) if output_attentions else None,
            output_lengths=out_lengths,
        )

    def output_lengths(self, lengths: Tensor) -> Tensor:
        """10 ms frame counts (B,) -> hidden-state counts (B,)."""
        return self.model.output_lengths(lengths)

    def normalize(self, features: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Raw log-mel (B, T, F) -> normalised as during pretraining; padding stays 0."""
        return self.normalizer(features, lengths)

    def features_from_waveforms(
        self, wavs: Tensor | Sequence[Tensor], lengths: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """16 kHz waveforms -> normalised features (B, T, F) and frame counts (B,), as the data
        layer computes them: a list of B 1-D waveforms (what s3prl passes, `pad_waveforms`), or
        (B, S) zero-padded with sample counts `lengths` (B,)."""
        if lengths is None:
            if isinstance(wavs, Tensor):
                raise WaveformError(
                    f"a padded waveform batch of shape {tuple(wavs.shape)} needs its sample "
                    "counts (lengths); or pass a list of 1-D waveforms"
                )
            wavs, lengths = pad_waveforms(wavs, self.mean.device)
        feats, frame_lengths = log_mel_batch(wavs, lengths, FeatureConfig(**self.feature_config))
        return self.normalize(feats, frame_lengths), frame_lengths

    def attention_weights(
        self, features: Tensor, lengths: Tensor, layer: int, head_mask: Tensor | None = None
    ) -> Tensor:
        """Attention weights (B, h, T', T') of depth `layer` (1..L), from its dense reference."""
        return self.model.attention_weights(features, lengths, layer, head_mask)


# Largest |sample| accepted: s3prl's Featurizer probes with unit-variance noise (peaks about
# 4.5), which must pass, int16-range samples (hundreds or thousands) must not.
MAX_ABS_AMPLITUDE = 32.0


class WaveformError(SpeechattnError, ValueError):
    """A waveform that cannot be used (type, shape, length, rate or values), named `wavs[i]`."""


def pad_waveforms(wavs: Sequence[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """B 16 kHz waveforms (a list of 1-D float tensors) -> zero-padded (B, S_max) float32 on
    `device` and sample counts (B,), each checked (`WaveformError`)."""
    if isinstance(wavs, Tensor) or not isinstance(wavs, list | tuple) or not wavs:
        found = f"a tensor of shape {tuple(wavs.shape)}" if isinstance(wavs, Tensor) else wavs
        raise WaveformError(
            f"expected a non-empty list of 1-D {SAMPLE_RATE} Hz waveforms, got {found!r}"
        )
    for i, wav in enumerate(wavs):
        if not isinstance(wav, Tensor) or not wav.is_floating_point():
            kind = wav.dtype if isinstance(wav, Tensor) else type(wav).__name__
            raise WaveformError(f"wavs[{i}]: expected a float waveform tensor, got {kind}")
        if wav.dim() != 1:
            raise WaveformError(
                f"wavs[{i}]: expected a 1-D {SAMPLE_RATE} Hz waveform (samples,), got shape "
                f"{tuple(wav.shape)} (mix channels to mono, one tensor per utterance)"
            )
        if wav.numel() < WIN_LENGTH:
            raise WaveformError(
                f"wavs[{i}]: {wav.numel()} samples is shorter than one {WIN_LENGTH}-sample "
                f"analysis window ({1000 * WIN_LENGTH // SAMPLE_RATE} ms at {SAMPLE_RATE} Hz)"
            )
    peaks = torch.stack([w.detach().abs().max().float() for w in wavs]).cpu()  # one host read
    for i, peak in enumerate(peaks.tolist()):
        if peak != peak or peak == float("inf"):  # NaN or inf somewhere in wavs[i]
            raise WaveformError(
                f"wavs[{i}]: the waveform holds NaN or infinite samples; check the audio "
                f"file or the preprocessing that produced it"
            )
        if peak > MAX_ABS_AMPLITUDE:
            raise WaveformError(
                f"wavs[{i}]: peak amplitude {peak:.4g} is far outside the float range "
                f"[-1, 1] ({MAX_ABS_AMPLITUDE:g} at most); int16 samples must be divided "
                f"by 32768 first"
            )
    lengths = torch.tensor([w.numel() for w in wavs], device=device)
    padded = torch.nn.utils.rnn.pad_sequence(
        [w.to(device=device, dtype=torch.float32) for w in wavs], batch_first=True
    )  # (B, S_max)
    return padded, lengths


class NonFiniteWeightsError(SpeechattnError, ValueError):
    """Weights or statistics hold NaN/inf: a diverged run, never written or loaded."""


def nonfinite_tensors(tensors: dict[str, Tensor]) -> list[str]:
    """Names of the floating-point tensors in `tensors` holding any NaN or inf, with one device
    sync in all (cheap enough to run every step)."""
    named = [(k, t) for k, t in tensors.items() if isinstance(t, Tensor) and t.is_floating_point()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in named])  # (N,) on their device
    return [k for (k, _), ok in zip(named, finite.tolist()) if not ok]


class ImplausibleWeightsError(NonFiniteWeightsError):
    """Weights finite but far larger than training produces (|w| > WEIGHT_LIMIT): a run that
    blew up without reaching inf (e.g. one AdamW step at lr=1e5), never written or loaded."""


# Largest |weight| accepted in an upstream. Trained AALBERTs stay within a few units (the
# LayerNorm gains are the largest, about 2); one step of AdamW at lr=1e5 gives about 1e5.
WEIGHT_LIMIT = 1e3


def _check_finite(state: dict[str, Any], where: str) -> None:
    """NaN/inf weights or statistics (`NonFiniteWeightsError`), or weights beyond
    WEIGHT_LIMIT (`ImplausibleWeightsError`): either way a diverged run."""
    norm = state["normalizer"] if isinstance(state["normalizer"], dict) else {}
    bad = nonfinite_tensors(state["state_dict"]) + [
        f"normalizer.{k}" for k in nonfinite_tensors(norm)
    ]
    if bad:
        raise NonFiniteWeightsError(
            f"{where}: {len(bad)} tensor(s) hold NaN/inf ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): the pretraining run diverged, so this "
            f"upstream is unusable; pretrain again with a smaller model.optimizer.lr"
        )
    floats = [
        (k, t)
        for k, t in state["state_dict"].items()
        if isinstance(t, Tensor) and t.is_floating_point() and t.numel()
    ]
    if not floats:
        return
    peaks = torch.stack([t.detach().abs().amax().float().cpu() for _, t in floats])  # (N,)
    if float(peaks.max()) > WEIGHT_LIMIT:
        worst = [k for (k, _), p in zip(floats, peaks.tolist()) if p > WEIGHT_LIMIT]
        raise ImplausibleWeightsError(
            f"{where}: {len(worst)} tensor(s) hold weights up to |w| = {float(peaks.max()):.3g}, "
            f"beyond {WEIGHT_LIMIT:g} ({', '.join(worst[:3])}{', ...' if len(worst) > 3 else ''}"
            f"; trained models stay within a few units): the pretraining run blew up, so this "
            f"upstream is unusable; pretrain again with a smaller model.optimizer.lr"
        )


def upstream_state(
    model: AALBERT, normalizer: Normalizer, feature_config: dict[str, Any], metadata: dict[str, Any]
) -> dict[str, Any]:
    """The dictionary stored in `upstream.pt` (tensors on CPU, plain values only)."""
    norm = normalizer.state_dict()
    return {
        "format": UPSTREAM_FORMAT,
        "version": UPSTREAM_VERSION,
        "model_config": model.config.to_dict(),
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "normalizer": {
            "mean": norm["mean"].cpu().float(),
            "std": norm["std"].cpu().float(),
            "mode": str(norm["mode"]),
        },
        "feature_config": dict(feature_config),
        "metadata": dict(metadata),
    }


def save_upstream(path: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` atomically (temp file + rename); `NonFiniteWeightsError` (nothing
    written) for NaN/inf or implausible weights."""
    path = Path(path)
    _check_finite(state, f"not writing {path}")
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return path


def _earlier_options(model_config: dict[str, Any], version: int) -> dict[str, Any]:
    """An older file's model config with the attention options it does not state set to the
    values it was trained with (`EARLIER_OPTIONS`), not to today's defaults."""
    from speechattn.attention import available

    name = model_config.get("attention")
    if name not in available():
        return model_config  # refused, naming the variant, when the model is rebuilt
    earlier: dict[str, object] = {}
    for changed, by_variant in sorted(EARLIER_OPTIONS.items(), reverse=True):
        if version < changed:  # the oldest change's values win: the file predates it
            earlier.update(by_variant.get(name, {}))
    options = {**earlier, **(model_config.get("attention_options") or {})}
    return {**model_config, "attention_options": options}


def load_upstream(path: str | Path, map_location: str | torch.device = "cpu") -> Upstream:
    """An `upstream.pt` file or an upstream folder, in eval mode.

    Raises `MissingFileError` (a FileNotFoundError) for a missing path, `UpstreamFileError` (a
    ValueError) naming the file and the problem for anything else that is not a readable
    upstream of a known version whose tensors its model config builds, and
    `NonFiniteWeightsError` for NaN/inf or implausibly large weights.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        state = _read_folder(path)
        config_where, weights_where = path / CONFIG_FILE, path / WEIGHTS_FILE
    else:
        state = _read_file(path)
        config_where = weights_where = path
    if not isinstance(state, dict) or state.get("format") != UPSTREAM_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise UpstreamFileError(
            f"{config_where} is not a speechattn upstream file: expected format "
            f"{UPSTREAM_FORMAT!r}, found {found!r}"
        )
    if state.get("version") not in READABLE_VERSIONS:
        raise UpstreamFileError(
            f"{config_where} has upstream format version {state.get('version')!r}; this "
            f"speechattn reads versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    required = ("model_config", "state_dict", "normalizer", "feature_config", "metadata")
    missing = set(required) - set(state)
    if missing:
        raise UpstreamFileError(f"{config_where} is incomplete: missing {sorted(missing)}")
    _check_finite(state, str(weights_where))
    if state["version"] < UPSTREAM_VERSION:
        state["model_config"] = _earlier_options(state["model_config"], state["version"])
    try:
        model = AALBERT(ModelConfig(**state["model_config"]))
    except Exception as e:  # unknown attention name or option, a bad setting
        raise UpstreamFileError(
            f"{config_where}: cannot rebuild the model: {type(e).__name__}: {e}"
        ) from e
    _check_tensors(model.state_dict(), state["state_dict"], weights_where)
    model.load_state_dict(state["state_dict"])
    try:
        normalizer = Normalizer.from_state_dict(state["normalizer"])
    except Exception as e:
        raise UpstreamFileError(f"{weights_where}: bad normalizer statistics: {e}") from e
    upstream = Upstream(model, normalizer, state["feature_config"], state["metadata"], str(path))
    return upstream.to(map_location).eval()


def _read_file(path: Path) -> Any:
    """The object in the torch file `path` (`weights_only=True`); errors name the file."""
    check_is_file(path, "upstream file", UpstreamFileError)
    try:
        return load_torch_file(path, "cpu", "upstream file")
    except TorchFileError as e:  # truncated zip, random bytes, pickled objects we refuse to run
        hint = ""
        if path.suffix == ".ckpt":
            hint = (
                " (this looks like a Lightning checkpoint; use the run's upstream.pt, or write "
                "one with `speechattn.tasks.pretrain.export_upstream(ckpt, out)`)"
            )
        raise UpstreamFileError(
            f"{path} is not a readable speechattn upstream file{hint}: "
            f"{describe_load_error(e.__cause__ or e, path)}"
        ) from e


def _check_tensors(expected: Mapping[str, Tensor], found: Mapping[str, Any], where: Path) -> None:
    """`UpstreamFileError` naming the first tensor the model config does not build exactly:
    missing, unexpected, not a tensor, or of another shape."""
    problems = [f"tensor {k!r} is missing" for k in expected if k not in found]
    problems += [f"unexpected tensor {k!r}" for k in found if k not in expected]
    for k, want in expected.items():
        got = found.get(k)
        if k in found and not (isinstance(got, Tensor) and got.shape == want.shape):
            shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
            problems.append(
                f"tensor {k!r} has shape {shape}, the model config needs {tuple(want.shape)}"
            )
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UpstreamFileError(
            f"{where}: cannot rebuild the model: {problems[0]}{more}; the weights do not "
            f"belong to this model config"
        )


def _read_folder(path: Path) -> dict[str, Any]:
    """An upstream folder as the dictionary `upstream.pt` holds: config.json parsed as JSON,
    model.safetensors read by safetensors (no pickle anywhere)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.exists() and not weights_file.exists():
        inside = sorted(p.name for p in path.glob("*.pt"))[:5]
        hint = f"; it holds {', '.join(inside)}: give that file" if inside else ""
        raise UpstreamFileError(
            f"upstream file {path} is a folder, not a file, and not an upstream folder (no "
            f"{CONFIG_FILE} or {WEIGHTS_FILE}){hint}"
        )
    for file in (config_file, weights_file):
        if not file.is_file():
            raise UpstreamFileError(
                f"upstream folder {path} is incomplete: {file.name} is missing (an upstream "
                f"folder holds {CONFIG_FILE} and {WEIGHTS_FILE}; export it again with "
                f"python -m speechattn.export)"
            )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UpstreamFileError(f"{config_file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise UpstreamFileError(
            f"{config_file}: expected a JSON object, found {type(config).__name__}"
        )
    try:
        tensors = load_file(weights_file, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:  # header or data cut off or damaged
        raise UpstreamFileError(
            f"{weights_file} is not a readable safetensors file (truncated or corrupt): {e}"
        ) from e
    normalizer = {n: tensors.pop(NORMALIZER_PREFIX + n, None) for n in ("mean", "std")}
    for n, t in normalizer.items():
        if t is None:
            raise UpstreamFileError(
                f"{weights_file}: cannot rebuild the model: tensor "
                f"{NORMALIZER_PREFIX + n!r} is missing"
            )
    mode = (config.get("normalizer") or {}).get("mode", "global")
    return {**config, "state_dict": tensors, "normalizer": {**normalizer, "mode": mode}}


def upstream_sha256(path: str | Path) -> str:
    """The identity of an upstream's contents, as result.json, heads.json and caches record it:
    a file's sha256, or for a folder the sha256 of its config.json's and model.safetensors'
    sha256 (the model card and anything else in it do not change the upstream)."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    parts = [file_sha256(path / name) for name in (CONFIG_FILE, WEIGHTS_FILE)]
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()


def save_upstream_folder(
    out: str | Path,
    state: dict[str, Any],
    source: dict[str, Any] | None = None,
    files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write `state` (`upstream_state`) as an upstream folder at `out`, atomically:
    config.json (with `source`, {"file", "sha256"} of its upstream.pt), model.safetensors and
    `files` (name -> bytes: the model card). Replaces an earlier upstream folder (one holding
    `FOLDER_FILES` only) but refuses (`OutputExistsError`) a file or any other folder there,
    which it would delete; `NonFiniteWeightsError` (nothing written) as `save_upstream`.
    """
    from safetensors.torch import save

    out = Path(out)
    _check_finite(state, f"not writing {out}")
    ours = {*FOLDER_FILES, *(files or {})}
    others = []  # what the folder at `out` holds besides an earlier upstream folder's files
    if out.is_dir() and not out.is_symlink():
        others = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if out.is_file() or others:
        what = "a file" if out.is_file() else f"a folder holding {', '.join(others[:5])}"
        raise OutputExistsError(
            f"{out} is {what}: an upstream folder replaces the whole folder, so it is "
            f"written only where nothing or an earlier upstream folder is; choose another"
        )
    # own contiguous copies: safetensors refuses tensors that share memory (tied weights)
    tensors = {
        k: v.detach().cpu().clone(memory_format=torch.contiguous_format)
        for k, v in state["state_dict"].items()
    }
    norm = state["normalizer"]
    tensors.update({NORMALIZER_PREFIX + n: norm[n].detach().cpu().float() for n in ("mean", "std")})
    config = {k: plain(state[k]) for k in ("format", "version", "model_config", "feature_config")}
    config |= {"normalizer": {"mode": str(norm["mode"])}, "metadata": plain(state["metadata"])}
    config["source"] = plain(source)
    with atomic_folder(out) as tmp:
        # "format": "pt" is the metadata Hugging Face's loaders expect of a PyTorch file
        atomic_write_bytes(tmp / WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))
        atomic_write_bytes(tmp / CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())
        for name, data in (files or {}).items():
            atomic_write_bytes(tmp / name, data)
    return out

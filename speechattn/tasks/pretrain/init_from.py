"""Continued pretraining: a new run that starts from an upstream's weights (`init_from=PATH`).

A new run in every other respect (fresh optimiser and schedule, step 0, this run's data, seed,
masking and normaliser). The architecture (`ModelConfig` but dropout) and the input features
(`FeatureConfig`, the normalisation mode) must equal the parent's, or the run is refused with
every difference named. With `ckpt_path` too, only a run started from the same upstream (same
sha256, recorded in its checkpoints) resumes: what a requeued job needs (`check_resume`). The
parent, {"path", "sha256"}, is recorded as `init_from` in the checkpoints, upstream.pt's
metadata, the model card and the exported folder's config.json.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from speechattn.data.features import FeatureConfig
from speechattn.errors import ConfigError, MissingFileError
from speechattn.model.aalbert import AALBERT, ModelConfig
from speechattn.model.upstream import Upstream, load_upstream, upstream_sha256

# ModelConfig fields a continued run may change: they do not change the weights' meaning
TRAINING_ONLY = ("dropout",)


def differences(
    parent: Upstream, model: ModelConfig, features: dict[str, Any], normalization: str | None
) -> list[str]:
    """Each setting of this run (`model`, `features`: FeatureConfig arguments, `normalization`:
    data.normalization or None when unknown) that differs from the upstream `parent`, as
    "SETTING: upstream VALUE, this run VALUE"."""
    out = []
    mine, theirs = asdict(model), parent.config.to_dict()
    for name in (f.name for f in fields(ModelConfig)):
        if name in TRAINING_ONLY:
            continue
        if name == "attention_options":  # one line per option, named as on the command line
            a, b = theirs[name] or {}, mine[name] or {}
            for key in sorted(set(a) | set(b), key=str):
                if a.get(key) != b.get(key):
                    out.append(_line(f"attention.options.{key}", a.get(key), b.get(key)))
        elif theirs[name] != mine[name]:
            setting = "attention" if name == "attention" else f"model.net.{name}"
            out.append(_line(setting, theirs[name], mine[name]))
    a, b = asdict(FeatureConfig(**parent.feature_config)), asdict(FeatureConfig(**features))
    out += [_line(f"data.{k}", a[k], b[k]) for k in a if a[k] != b[k]]
    if normalization is not None and parent.normalizer.mode != normalization:
        out.append(_line("data.normalization", parent.normalizer.mode, normalization))
    return out


def _line(setting: str, parent: Any, mine: Any) -> str:
    return f"{setting}: upstream {parent!r}, this run {mine!r}"


def init_from_upstream(
    model: AALBERT, path: str | Path, features: dict[str, Any], normalization: str | None
) -> dict[str, str]:
    """Copy the weights of the upstream at `path` (an upstream.pt or an upstream folder) into
    `model`, after checking that they fit (`ConfigError` listing every difference). Returns
    the record of the parent, {"path": resolved path, "sha256": `upstream_sha256`}."""
    path = Path(path).expanduser()
    parent = load_upstream(path)  # its errors name the file and the problem
    found = differences(parent, model.config, features, normalization)
    if found:
        raise ConfigError(
            f"init_from={path}: this run's model or input features differ from the upstream's, "
            f"so its weights do not fit: {'; '.join(found)}. Continued pretraining keeps the "
            f"architecture and the features: set these to the upstream's values"
        )
    model.load_state_dict(parent.model.state_dict())
    return {"path": str(path.resolve()), "sha256": upstream_sha256(path)}


def check_resume(init_from: str | Path, checkpoint: dict[str, Any], resume: Path) -> None:
    """`init_from` together with a checkpoint to resume: allowed only when the checkpoint's run
    started from that same upstream (then it resumes, the checkpoint's weights winning);
    otherwise `ConfigError`, since it is unclear which weights the run should start from."""
    path = Path(init_from).expanduser()
    if not path.exists():
        raise MissingFileError(f"init_from={init_from}: no such upstream file or folder")
    recorded = (checkpoint.get("speechattn_data") or {}).get("init_from")
    sha = upstream_sha256(path)
    if recorded and recorded.get("sha256") == sha:
        return
    started = f"from the upstream {recorded['path']}" if recorded else "from scratch"
    raise ConfigError(
        f"init_from={init_from} with ckpt_path={resume}: that checkpoint's run started "
        f"{started}, not from this upstream, so which weights to start from is ambiguous. "
        f"To resume that run drop init_from; to start a new run from the upstream drop "
        f"ckpt_path (a new run folder keeps the other run's checkpoints)"
    )


__all__ = ["TRAINING_ONLY", "check_resume", "differences", "init_from_upstream"]

"""Where a pretraining run starts from: which checkpoint `ckpt_path=last` means, whether it may
continue under today's settings (`resume_from`, asked before any data is read), an upstream's
weights for a new run (`init_from_upstream`) and the lock that keeps one run per run directory.
A checkpoint continues only the run it came from: Lightning would load its weights into another
architecture wherever the shapes fit and keep the old optimiser's state, while the metadata
stated the new settings. Users' view: docs/preemption.md, docs/upstream.md (`init_from`).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from speechattn.data.claims import ClaimConfig, Claims, read_claim
from speechattn.data.features import FeatureConfig
from speechattn.errors import ConfigError, MissingFileError, SpeechattnError
from speechattn.model.aalbert import AALBERT, ModelConfig
from speechattn.model.masking import MaskingConfig
from speechattn.model.optim import OptimConfig
from speechattn.model.serialization import TorchFileError, load_torch_file
from speechattn.model.upstream import Upstream, load_upstream, upstream_sha256
from speechattn.tasks.preemption import TrainingStopped
from speechattn.utils import plain

if TYPE_CHECKING:
    from speechattn.tasks.pretrain.module import PretrainTask

log = logging.getLogger("speechattn.pretrain")


def checkpoint_step(path: Path) -> int | None:
    """The `global_step` of the Lightning checkpoint `path` (memory-mapped: the header only),
    None when it cannot be read safely (truncated, corrupt, refused by `weights_only`)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(ckpt["global_step"])
    except Exception:  # whatever is wrong with it, it is not a checkpoint to pick
        return None


def _newest(steps: dict[Path, int | None]) -> Path | None:
    """The readable checkpoint with the highest step; on a tie `last.ckpt`, then the newest."""
    readable = [p for p, s in steps.items() if s is not None]
    return max(
        readable, key=lambda p: (steps[p], p.name == "last.ckpt", p.stat().st_mtime), default=None
    )


def newest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The checkpoint of `checkpoint_dir` with the highest step, whatever its name (Lightning
    writes `last-v1.ckpt` beside a `last.ckpt` of a copied run directory), None when there is
    none. An unreadable `last*.ckpt` is returned as it stands, so that the resume stops naming
    it and the newest intact checkpoint rather than quietly going back further."""
    steps = {p: checkpoint_step(p) for p in sorted(checkpoint_dir.glob("*.ckpt")) if p.is_file()}
    damaged = [p for p, s in steps.items() if s is None and p.name.startswith("last")]
    return damaged[0] if damaged else _newest(steps)


def periodic_checkpoints(checkpoint_dir: Path, every_n_steps: int, keep: int) -> ModelCheckpoint:
    """`step=NNNNNNN.ckpt` every `every_n_steps` steps (the newest `keep`, -1 all) and
    `last.ckpt`, overwritten in place (never `last-v1.ckpt` in a copied run directory)."""
    return ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename="step={step:07d}",
        auto_insert_metric_name=False,
        every_n_train_steps=every_n_steps,
        save_top_k=keep,
        monitor="step" if keep != -1 else None,
        mode="max",
        save_last=True,
        save_on_train_epoch_end=False,
        enable_version_counter=False,
    )


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> Path | None:
    """`null` -> fresh run; `last` -> the newest checkpoint of <run dir>/checkpoints, else a
    fresh run with a warning naming an earlier run that could be resumed; a path -> that file."""
    if ckpt_path in (None, "", "null"):
        return None
    if ckpt_path != "last":
        path = Path(ckpt_path).expanduser()
        if not path.is_file():
            raise MissingFileError(f"ckpt_path={ckpt_path}: no such checkpoint file")
        return path
    newest = newest_checkpoint(output_dir / "checkpoints")
    if newest is not None:
        if newest.name != "last.ckpt":
            log.info("ckpt_path=last: the newest checkpoint is %s", newest)
        return newest
    earlier = sorted(output_dir.parent.glob("*/checkpoints/last*.ckpt"), key=os.path.getmtime)
    hint = ""
    if earlier:
        run_dir = str(earlier[-1].parent.parent)
        hint = f"; to resume the latest earlier run add {override('hydra.run.dir', run_dir)}"
    warnings.warn(
        f"ckpt_path=last: no checkpoint in {output_dir / 'checkpoints'}, starting from "
        f"scratch{hint}",
        stacklevel=2,
    )
    return None


def warn_if_requeued_from_scratch(resume: Path | None, output_dir: Path) -> None:
    """Warn that a requeued SLURM job starts over (no `ckpt_path=last` in a fixed run dir)."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if resume is None and restarts not in ("", "0"):
        warnings.warn(
            f"this SLURM job was requeued (SLURM_RESTART_COUNT={restarts}) but training starts "
            f"from scratch in {output_dir}: submit it with hydra.run.dir=<a fixed directory, "
            f"e.g. outputs/pretrain/slurm-$SLURM_JOB_ID> ckpt_path=last (docs/preemption.md)",
            stacklevel=2,
        )


TRAINING_ONLY = ("dropout",)  # ModelConfig fields a continued run may change


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
    """Copy the weights of the upstream at `path` (an upstream.pt or folder) into `model` once
    they fit (`ConfigError` listing every difference); returns the parent's record,
    {"path": resolved path, "sha256": `upstream_sha256`}."""
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


def check_init_resume(init_from: str | Path, checkpoint: dict[str, Any], resume: Path) -> None:
    """`init_from` with a checkpoint to resume: allowed only when the checkpoint's run started
    from that same upstream (what a requeued job needs), else `ConfigError` (ambiguous)."""
    path = Path(init_from).expanduser()
    if not path.exists():
        raise MissingFileError(f"init_from={init_from}: no such upstream file or folder")
    recorded = (checkpoint.get("speechattn_data") or {}).get("init_from")
    if recorded and recorded.get("sha256") == upstream_sha256(path):
        return
    started = f"from the upstream {recorded['path']}" if recorded else "from scratch"
    raise ConfigError(
        f"init_from={init_from} with ckpt_path={resume}: that checkpoint's run started "
        f"{started}, not from this upstream, so which weights to start from is ambiguous. "
        f"To resume that run drop init_from; to start a new run from the upstream drop "
        f"ckpt_path (a new run folder keeps the other run's checkpoints)"
    )


def read_checkpoint(path: Path) -> dict[str, Any]:
    """`path` read safely (`weights_only=True`) before Lightning does. `TorchFileError` naming
    it when it is truncated, corrupt or refused (with the newest intact checkpoint beside it,
    as an override to paste) or not a checkpoint of `python -m speechattn.pretrain`."""
    try:
        checkpoint = load_torch_file(path, "cpu", "checkpoint to resume")
    except TorchFileError as e:
        steps = {p: checkpoint_step(p) for p in path.parent.glob("*.ckpt") if p != path}
        newest = _newest(steps)
        if newest is not None:
            hint = (
                f"resume from the newest intact checkpoint instead (step {steps[newest]}): "
                f"{override('ckpt_path', str(newest))}"
            )
        else:
            hint = f"no intact checkpoint in {path.parent}: start afresh without ckpt_path"
        raise TorchFileError(f"{e}; {hint}") from e
    expected = ("global_step", "state_dict", "hyper_parameters", "optimizer_states")
    missing = [k for k in expected if not isinstance(checkpoint, dict) or k not in checkpoint]
    if missing or "model" not in (checkpoint.get("hyper_parameters") or {}):
        if isinstance(checkpoint, dict) and all(torch.is_tensor(v) for v in checkpoint.values()):
            kind = f"a plain dict of {len(checkpoint)} tensors"  # a bare state_dict
        else:
            kind = f"a {type(checkpoint).__name__}"
        found = sorted(map(str, checkpoint))[:4] if isinstance(checkpoint, dict) else []
        raise TorchFileError(
            f"ckpt_path={path}: not a checkpoint of `python -m speechattn.pretrain` ({kind}, "
            f"keys {found}, lacking {missing or ['hyper_parameters.model']}): resume from a "
            f"run's checkpoints/*.ckpt, or start afresh without ckpt_path"
        )
    return checkpoint


# the settings a checkpoint must agree with: (setting as on the command line, its key in the
# checkpoint's hyper_parameters, its schema); feature_dim follows the data's, compared itself
GROUPS = (
    ("model.net", "model", ModelConfig),
    ("model.masking", "masking", MaskingConfig),
    ("model.optimizer", "optimizer", OptimConfig),
)
DATA_KEYS = ("n_mels", "deltas", "normalization")
NEVER_CHANGED = ("model.optimizer.name",)  # the optimiser's state is that optimiser's


def settings_of(hyper_parameters: dict[str, Any], data_config: dict[str, Any]) -> dict[str, Any]:
    """The settings a resume must keep, flat ("model.net.num_heads" -> 8), from a checkpoint's
    `hyper_parameters` and data config or from today's (`PretrainTask`'s arguments and
    `plain(cfg.data)`), normalised by the dataclasses (a tuple equals the same list)."""
    flat: dict[str, Any] = {"seed": hyper_parameters.get("seed")}
    for setting, key, schema in GROUPS:
        for name, value in vars(schema(**(hyper_parameters.get(key) or {}))).items():
            if name != "feature_dim":
                flat[f"{setting}.{name}"] = list(value) if isinstance(value, tuple) else value
    flat.update({f"data.{k}": data_config[k] for k in DATA_KEYS if k in data_config})
    return flat


def allowed_changes(
    cfg: DictConfig, checkpoint: dict[str, Any], path: Path, step: int
) -> list[dict[str, Any]]:
    """The settings of `cfg` that differ from the checkpoint's (`path`, at `step`): refused
    (`ConfigError` listing them and what to do) unless each is named in
    `allow_resume_changes`; returns them as {"step", "setting", "checkpoint", "now"} to record.
    `TorchFileError` naming the file when its settings are not this speechattn's."""
    old_data = (checkpoint.get("speechattn_data") or {}).get("data_config") or {}
    try:
        before = settings_of(checkpoint["hyper_parameters"], old_data)
    except (TypeError, ValueError) as e:  # written by another version of the model's settings
        raise TorchFileError(
            f"ckpt_path={path}: its settings do not describe a model of this speechattn "
            f"({type(e).__name__}: {e}); start afresh without ckpt_path"
        ) from e
    today = {key: plain(OmegaConf.select(cfg, setting)) for setting, key, _ in GROUPS}
    now = settings_of({**today, "seed": cfg.seed}, plain(cfg.get("data")) or {})
    differences = {k: (v, now[k]) for k, v in before.items() if k in now and v != now[k]}
    allowed = [str(s) for s in cfg.get("allow_resume_changes") or []]
    unknown = [a for a in allowed if a not in differences]
    if unknown:
        log.warning("allow_resume_changes names %s, which the checkpoint agrees with", unknown)
    refused = {k: v for k, v in differences.items() if k not in allowed or k in NEVER_CHANGED}
    if refused:
        listed = "; ".join(
            f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in refused.items()
        )
        fixed = [k for k in refused if k in NEVER_CHANGED]
        advice = (
            f"{', '.join(fixed)} cannot change in a resume (the optimiser state is the old "
            f"optimiser's): start a fresh run"
            if fixed
            else "resume with the checkpoint's settings, start a fresh run (another "
            "hydra.run.dir), or continue with the new ones and have the change recorded: "
            f"allow_resume_changes=[{','.join(refused)}]"
        )
        raise ConfigError(
            f"ckpt_path={path} (step {step}) was trained with other settings than this run's: "
            f"{listed}. {advice}"
        )
    recorded = "allow_resume_changes; recorded in upstream.pt's metadata as resume_changes"
    for k, (old, new) in differences.items():
        log.warning(
            "resuming with %s changed from %r to %r at step %d (%s)", k, old, new, step, recorded
        )
    return [
        {"step": step, "setting": k, "checkpoint": old, "now": new}
        for k, (old, new) in differences.items()
    ]


@dataclass
class Resume:
    """The checkpoint a run continues: file, step, allowed changes to record, weight shapes."""

    path: Path
    step: int
    changes: list[dict[str, Any]]
    shapes: dict[str, tuple[int, ...]]

    def check_fits(self, task: PretrainTask) -> None:
        """`ConfigError` naming the file when the checkpoint's weights do not fit `task` (keys,
        shapes), instead of Lightning's error naming neither; then hand `task` the changes."""
        saved, wanted = self.shapes, {k: tuple(v.shape) for k, v in task.state_dict().items()}
        problems = {
            "missing": sorted(set(wanted) - set(saved)),
            "unexpected": sorted(set(saved) - set(wanted)),
            "shapes (checkpoint vs now)": [
                f"{k} {saved[k]} vs {wanted[k]}"
                for k in sorted(set(saved) & set(wanted))
                if saved[k] != wanted[k]
            ],
        }
        parts = [
            f"{what}: {', '.join(items[:3])}{', ...' if len(items) > 3 else ''}"
            for what, items in problems.items()
            if items
        ]
        if parts:
            raise ConfigError(
                f"ckpt_path={self.path}: its weights do not fit the model configured now "
                f"({'; '.join(parts)}): resume with the checkpoint's model settings or start "
                "a fresh run"
            )
        task.resume_changes = self.changes


def resume_from(cfg: DictConfig, output_dir: Path) -> Resume | None:
    """The checkpoint `cfg.ckpt_path` names for the run in `output_dir`, checked against `cfg`
    and `cfg.init_from` before any data is read; None for a fresh run."""
    path = resolve_ckpt_path(cfg.get("ckpt_path"), output_dir)
    warn_if_requeued_from_scratch(path, output_dir)
    if path is None:
        return None
    checkpoint = read_checkpoint(path)
    step = int(checkpoint["global_step"])
    if cfg.get("init_from"):
        check_init_resume(cfg.init_from, checkpoint, path)
    changes = allowed_changes(cfg, checkpoint, path, step)
    shapes = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()}
    return Resume(path, step, changes, shapes)


_PLAIN_VALUE = re.compile(r"[\w/\-+.:~%@?*]+")  # needs no quotes in a Hydra override


def override(key: str, value: str) -> str:
    """`key=value` as one shell word that Hydra's override parser reads back as `value`: a
    value with characters the parser treats as syntax (`=` in `step=0000030.ckpt`, spaces,
    commas, brackets) is single-quoted for Hydra, and the word quoted for the shell."""
    if _PLAIN_VALUE.fullmatch(value):
        return f"{key}={value}"
    quoted = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    word = f"{key}={quoted}"
    if not re.search(r'["$`\\!]', word):
        return f'"{word}"'  # readable: "ckpt_path='/runs/a/step=0000030.ckpt'"
    return shlex.quote(word)


def resume_hint(output_dir: Path) -> str:
    """The command that resumes the run in `output_dir` (this process's Hydra overrides)."""
    overrides: list[str] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        task = HydraConfig.get().overrides.task
        overrides = [o for o in task if not o.startswith("ckpt_path=")]
    except (ImportError, ValueError):  # run(cfg) called outside Hydra
        pass
    words = [*(shlex.quote(o) for o in overrides), override("hydra.run.dir", str(output_dir))]
    return " ".join(["python -m speechattn.pretrain", *words, "ckpt_path=last"])


@contextmanager
def earlier_result_noted(output_dir: Path, resume: Resume | None) -> Iterator[None]:
    """Around a resumed run's work: the upstream.pt an earlier finish of `output_dir` left
    stays until this run replaces it, so any error that ends the run first (rank zero) says
    that file is not this run's result (in a `TrainingStopped`'s message too)."""
    upstream = output_dir / "upstream.pt"
    if resume is None or rank_zero_only.rank != 0 or not upstream.is_file():
        yield
        return
    try:  # memory-mapped: reads the metadata, not the weights
        meta = torch.load(upstream, map_location="cpu", weights_only=True, mmap=True)["metadata"]
        step = f"at step {int(meta['steps'])}"
    except Exception:  # unreadable: it is still not this run's result
        step = "of unknown step"
    earlier = (
        f"{upstream} (and README.md, its model card) is an earlier result of this run "
        f"directory, {step}"
    )
    log.warning("%s: it stays until this run finishes and replaces it", earlier)
    try:
        yield
    except BaseException as error:  # a stop, a divergence, a crash
        note = f"{earlier}; this run has no result until it is resumed and finishes"
        log.warning("%s", note)
        if isinstance(error, TrainingStopped):
            error.message += f". {note}"
        raise


class RunInUseError(SpeechattnError):
    """Another live run writes the same run directory."""


class RunLockLost(SpeechattnError, RuntimeError):
    """This run's lock passed to another run while this one was silent: it writes no more."""


class RunLock(L.Callback):
    """`<run dir>/run.claim` held for a whole run (`with RunLock(dir): ...`) and checked, as the
    first of the run's callbacks, before each write into the folder (a metrics row, a
    validation, a checkpoint). Takeover rules: docs/preemption.md ("One run per run
    directory"). `hold=False` (DDP ranks but zero, which write nothing) claims nothing."""

    UNIT = "run"

    def __init__(self, run_dir: Path, config: ClaimConfig | None = None, hold: bool = True) -> None:
        self.run_dir = run_dir
        self.config = config or ClaimConfig()
        self.claims = Claims(run_dir, self.config, pid_holds=True) if hold else None

    def check(self) -> None:
        """Raise `RunLockLost` naming the new holder unless the run directory's claim is still
        this run's (read now, by token: the heartbeat may not have run since a long pause)."""
        if self.claims is None:
            return
        path = self.claims.path(self.UNIT)
        info, token = read_claim(path), self.claims.token(self.UNIT)
        if info is not None and token is not None and info.token == token:
            return
        other = f"by {info}" if info is not None else "removed"
        raise RunLockLost(
            f"run directory {self.run_dir}: this run's lock ({path}) was {other} while this "
            f"run was silent for over {self.config.expiry_s:.0f} s (stopped or frozen); it "
            "stops without writing more there, so that two runs never write one folder"
        )

    def _check(self, *args: Any) -> None:
        self.check()

    on_train_batch_end = on_validation_end = on_save_checkpoint = _check

    def __enter__(self) -> RunLock:
        if self.claims is not None:
            self.claims.__enter__()
            try:
                self._acquire(self.claims)
            except BaseException:
                self.claims.close()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.claims is not None:
            self.claims.close()

    def _acquire(self, claims: Claims) -> None:
        deadline = None
        while not claims.try_claim(self.UNIT):
            holder = claims.holder(self.UNIT)
            if holder is None:
                continue  # released meanwhile: try again
            same_machine = holder.host == claims.host and holder.machine == claims.machine
            if same_machine or (deadline is not None and time.monotonic() > deadline):
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.started))
                raise RunInUseError(
                    f"run directory {self.run_dir} is in use by another run ({holder}, "
                    f"started {started}; lock {holder.path}): wait for it to end, or choose "
                    "another hydra.run.dir"
                )
            if deadline is None:  # another host: alive, or dead and not yet silent long enough
                wait = self.config.expiry_s + self.config.heartbeat_s
                deadline = time.monotonic() + wait
                log.warning(
                    "run directory %s is locked by %s on another host; waiting up to %.0f s to "
                    "see whether that run is dead (%s)",
                    self.run_dir,
                    holder,
                    wait,
                    holder.path,
                )
            time.sleep(self.config.poll_s)

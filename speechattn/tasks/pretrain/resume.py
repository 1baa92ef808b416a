"""Resuming a pretraining run: which checkpoint `ckpt_path=last` means (`newest_checkpoint`),
whether it may continue under today's settings (`resume_from`, asked before any data is read),
and the lock that keeps one run per run directory (`RunLock`).

A checkpoint continues only the run it came from: Lightning would load its weights into
another architecture wherever the shapes allow (`num_heads=4` against 8 heads) and keep its
optimiser state under another optimiser's settings, and the metadata would state the new
settings as what trained. Differences are refused, listed, unless each is named in
`allow_resume_changes`: then it is recorded (`resume_changes` in the checkpoints and in
upstream.pt's metadata) and takes effect from the resume on.
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from speechattn.data.claims import ClaimConfig, Claims, read_claim
from speechattn.errors import ConfigError, MissingFileError, SpeechattnError
from speechattn.model.serialization import TorchFileError, load_torch_file
from speechattn.tasks.preemption import TrainingStopped
from speechattn.tasks.pretrain.init_from import check_resume as check_init_resume
from speechattn.utils import plain

if TYPE_CHECKING:
    from speechattn.tasks.pretrain.module import PretrainTask

log = logging.getLogger("speechattn.pretrain")

# ----------------------------------------------------------------------------- which checkpoint


def checkpoint_step(path: Path) -> int | None:
    """The `global_step` stored in the Lightning checkpoint `path`, None when it cannot be read
    safely (truncated, corrupt, holding objects `weights_only` refuses). Memory-mapped: only
    the pickled header is read, not the weights."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(ckpt["global_step"])
    except Exception:  # whatever is wrong with it, it is not a checkpoint to pick
        return None


def newest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The checkpoint of `checkpoint_dir` with the highest step (`last.ckpt`, `last-vN.ckpt`,
    `step=NNNNNNN[-vN].ckpt`; on a tie `last.ckpt`, then the newest file), None when there is
    none. Lightning writes `last-v1.ckpt` when `last.ckpt` is a file it does not think its own
    (a copied or moved run directory), and `last.ckpt` then stays behind. An unreadable `last*.ckpt` is returned as it stands: the resume then stops with an
    error naming it and the newest intact checkpoint, rather than quietly going back further."""
    files = sorted(p for p in checkpoint_dir.glob("*.ckpt") if p.is_file())
    if not files:
        return None
    steps = {p: checkpoint_step(p) for p in files}
    damaged = [p for p, s in steps.items() if s is None and p.name.startswith("last")]
    if damaged:
        return damaged[0]
    readable = [p for p, s in steps.items() if s is not None]
    if not readable:
        return None
    return max(readable, key=lambda p: (steps[p], p.name == "last.ckpt", p.stat().st_mtime))


def periodic_checkpoints(checkpoint_dir: Path, every_n_steps: int, keep: int) -> ModelCheckpoint:
    """The run's resumable checkpoints: `step=NNNNNNN.ckpt` every `every_n_steps` steps (the
    newest `keep`, -1 all) and `last.ckpt`."""
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
        # overwrite, never `last-v1.ckpt`: in a copied or moved run directory Lightning would
        # not take last.ckpt for its own and write beside it (newest_checkpoint finds either)
        enable_version_counter=False,
    )


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> Path | None:
    """`null` -> fresh run; `last` -> the newest checkpoint of <run dir>/checkpoints (highest
    step, whatever Lightning named it: `newest_checkpoint`), else a fresh run with a warning
    naming earlier runs that could be resumed; a path -> that file."""
    if ckpt_path in (None, "", "null"):
        return None
    if ckpt_path == "last":
        newest = newest_checkpoint(output_dir / "checkpoints")
        if newest is not None:
            if newest.name != "last.ckpt":
                log.info("ckpt_path=last: the newest checkpoint is %s", newest)
            return newest
        hint = ""
        candidates = sorted(
            output_dir.parent.glob("*/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime
        )
        if candidates:
            earlier = candidates[-1].parent.parent
            hint = (
                f"; to resume the latest earlier run add {override('hydra.run.dir', str(earlier))}"
            )
        warnings.warn(
            f"ckpt_path=last: no checkpoint in {output_dir / 'checkpoints'}, starting from "
            f"scratch{hint}",
            stacklevel=2,
        )
        return None
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise MissingFileError(f"ckpt_path={ckpt_path}: no such checkpoint file")
    return path


def warn_if_requeued_from_scratch(resume: Path | None, output_dir: Path) -> None:
    """A requeued SLURM job reruns its command: without `ckpt_path=last` in a fixed run
    directory it starts over and the hours before the requeue are lost. Say so."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if resume is None and restarts not in ("", "0"):
        warnings.warn(
            f"this SLURM job was requeued (SLURM_RESTART_COUNT={restarts}) but training starts "
            f"from scratch in {output_dir}: submit it with hydra.run.dir=<a fixed directory, "
            f"e.g. outputs/pretrain/slurm-$SLURM_JOB_ID> ckpt_path=last (docs/preemption.md)",
            stacklevel=2,
        )


# ----------------------------------------------------------------------------- may it continue


def check_resume_checkpoint(path: Path) -> dict[str, Any]:
    """Read `path` safely (`weights_only=True`) before Lightning does and return it. Raises
    `TorchFileError` naming it: when it is truncated, corrupt or refused (with the newest
    intact checkpoint beside it, as an override to paste), or when it is not a checkpoint of
    `python -m speechattn.pretrain` (a plain dict of weights, another program's file)."""
    try:
        checkpoint = load_torch_file(path, "cpu", "checkpoint to resume")
    except TorchFileError as e:
        steps = {p: checkpoint_step(p) for p in path.parent.glob("*.ckpt") if p != path}
        intact = [p for p, step in steps.items() if step is not None]
        if intact:
            newest = max(intact, key=lambda p: (steps[p], p.name))
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


# the settings a checkpoint must agree with: (setting as on the command line, where the
# checkpoint keeps it). The model's feature_dim follows the data's n_mels and deltas.
MODEL_GROUPS = (
    ("model.net", "model"),
    ("model.masking", "masking"),
    ("model.optimizer", "optimizer"),
)
DATA_KEYS = ("n_mels", "deltas", "normalization")


def settings_of(hyper_parameters: dict[str, Any], data_config: dict[str, Any]) -> dict[str, Any]:
    """The settings a resume must keep, flat ("model.net.num_heads" -> 8), from a checkpoint's
    `hyper_parameters` and data config or from today's (the same shapes: `PretrainTask`'s
    arguments and `plain(cfg.data)`). Values are normalised by the dataclasses, so a tuple
    and a list of the same betas compare equal."""
    from speechattn.model.aalbert import ModelConfig
    from speechattn.model.masking import MaskingConfig
    from speechattn.model.optim import OptimConfig

    schemas = {"model": ModelConfig, "masking": MaskingConfig, "optimizer": OptimConfig}
    flat: dict[str, Any] = {}
    for setting, key in MODEL_GROUPS:
        config = schemas[key](**(hyper_parameters.get(key) or {}))
        for name, value in vars(config).items():
            if name != "feature_dim":
                flat[f"{setting}.{name}"] = list(value) if isinstance(value, tuple) else value
    flat["seed"] = hyper_parameters.get("seed")
    for name in DATA_KEYS:
        if name in data_config:
            flat[f"data.{name}"] = data_config[name]
    return flat


def resume_differences(
    checkpoint: dict[str, Any], path: Path, hyper_parameters: dict[str, Any], data_config: dict
) -> dict[str, tuple[Any, Any]]:
    """Setting -> (checkpoint's value, today's value) for every setting the run would change by
    resuming `checkpoint` (a pretraining checkpoint read from `path`). Raises `TorchFileError`
    naming the file when its settings are not this speechattn's."""
    saved = checkpoint["hyper_parameters"]
    old_data = (checkpoint.get("speechattn_data") or {}).get("data_config") or {}
    try:
        before = settings_of(saved, old_data)
    except (TypeError, ValueError) as e:  # written by another version of the model's settings
        raise TorchFileError(
            f"ckpt_path={path}: its settings do not describe a model of this speechattn "
            f"({type(e).__name__}: {e}); start afresh without ckpt_path"
        ) from e
    now = settings_of(hyper_parameters, data_config)
    return {k: (before[k], now[k]) for k in before if k in now and before[k] != now[k]}


# settings a recorded override cannot make work: the optimiser's state is another optimiser's
NEVER_CHANGED = ("model.optimizer.name",)


def check_resume_settings(
    differences: dict[str, tuple[Any, Any]], allowed: list[str], path: Path, step: int
) -> list[dict[str, Any]]:
    """Refuse `differences` (ConfigError listing them and what to do) unless every one is named
    in `allowed` (the `allow_resume_changes` setting); returns the allowed changes to record,
    one {"step", "setting", "checkpoint", "now"} per setting."""
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
    for k, (old, new) in differences.items():
        log.warning(
            "resuming with %s changed from %r to %r at step %d (allow_resume_changes; recorded "
            "in upstream.pt's metadata as resume_changes)",
            k,
            old,
            new,
            step,
        )
    return [
        {"step": step, "setting": k, "checkpoint": old, "now": new}
        for k, (old, new) in differences.items()
    ]


def check_state_dict(checkpoint: dict[str, Any], path: Path, model: torch.nn.Module) -> None:
    """Raise `ConfigError` naming `path` when the checkpoint's weights do not fit `model` (keys
    or shapes), instead of Lightning's `Error(s) in loading state_dict` naming neither."""
    saved = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()}
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    shapes = [
        f"{k} {saved[k]} vs {wanted[k]}"
        for k in sorted(set(saved) & set(wanted))
        if saved[k] != wanted[k]
    ]
    if missing or extra or shapes:
        parts = [
            f"{what}: {', '.join(items[:3])}{', ...' if len(items) > 3 else ''}"
            for what, items in (
                ("missing", missing),
                ("unexpected", extra),
                ("shapes (checkpoint vs now)", shapes),
            )
            if items
        ]
        raise ConfigError(
            f"ckpt_path={path}: its weights do not fit the model configured now "
            f"({'; '.join(parts)}): "
            f"resume with the checkpoint's model settings or start a fresh run"
        )


@dataclass
class Resume:
    """The checkpoint a run continues (`resume_from`): its file, its step, and the changes of
    settings against it that `allow_resume_changes` allows (recorded in what the run writes)."""

    path: Path
    step: int
    changes: list[dict[str, Any]]
    checkpoint: dict[str, Any] | None  # as read for the checks; dropped by `check_fits`

    def check_fits(self, task: PretrainTask) -> None:
        """Weights that do not fit `task`: say so before Lightning loads them
        (`check_state_dict`). Then hand `task` the changes to record, and let go of the
        checkpoint (Lightning reads the file again in fit)."""
        assert self.checkpoint is not None, "check_fits runs once"
        check_state_dict(self.checkpoint, self.path, task)
        task.resume_changes = self.changes
        self.checkpoint = None


def resume_from(cfg: DictConfig, output_dir: Path) -> Resume | None:
    """The checkpoint `cfg.ckpt_path` names for the run in `output_dir`, read and checked
    against `cfg` (and against `cfg.init_from`, `init_from.check_resume`); None for a fresh
    run. Raises the errors that refuse the resume, before any data is read."""
    path = resolve_ckpt_path(cfg.get("ckpt_path"), output_dir)
    warn_if_requeued_from_scratch(path, output_dir)
    if path is None:
        return None
    checkpoint = check_resume_checkpoint(path)
    step = int(checkpoint["global_step"])
    if cfg.get("init_from"):  # resume only the run it started
        check_init_resume(cfg.init_from, checkpoint, path)
    today = {
        "model": plain(cfg.model.net),
        "masking": plain(cfg.model.masking),
        "optimizer": plain(cfg.model.optimizer),
        "seed": cfg.seed,
    }
    differences = resume_differences(checkpoint, path, today, plain(cfg.get("data")) or {})
    allowed = [str(s) for s in cfg.get("allow_resume_changes") or []]
    changes = check_resume_settings(differences, allowed, path, step)
    return Resume(path, step, changes, checkpoint)


# ----------------------------------------------------------------------------- hints


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
    """The command that resumes the run in `output_dir`: this process's own command line
    (its Hydra overrides, when run through Hydra) with the run directory and `ckpt_path=last`."""
    overrides: list[str] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        task = HydraConfig.get().overrides.task
        overrides = [o for o in task if not o.startswith("ckpt_path=")]
    except (ImportError, ValueError):  # run(cfg) called outside Hydra
        pass
    words = [*(shlex.quote(o) for o in overrides), override("hydra.run.dir", str(output_dir))]
    return " ".join(["python -m speechattn.pretrain", *words, "ckpt_path=last"])


# ----------------------------------------------------------------------------- an earlier result


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


# ----------------------------------------------------------------------------- the run's lock


class RunInUseError(SpeechattnError):
    """Another live run writes the same run directory."""


class RunLockLost(SpeechattnError, RuntimeError):
    """This run's lock passed to another run while this one was silent: it writes no more."""


class RunLock(L.Callback):
    """`<run dir>/run.claim` held for a whole run (`with RunLock(dir): ...`), and checked, as
    one of the run's callbacks, before the run writes into its folder: a metrics row, a
    validation's row, a checkpoint (Lightning calls `on_save_checkpoint` before the file is
    written). Put it first among the callbacks, so that its check runs before their writes.

    A claim of a process of this machine holds while that process exists, however long it is
    silent (a stopped run is not dead), and is taken over at once when it is gone (logged);
    one of another host is dead once it has missed its heartbeats for `config.expiry_s`: a
    requeued job that lands on another node within that time waits for it (logged), a live run
    keeps it fresh and the second run is refused with `RunInUseError` naming the holder. A run
    of another host that was silent that long and lost its lock finds out at its next write
    (`check`, fencing by the claim's token) and stops with `RunLockLost`.

    `hold=False` claims and checks nothing: the DDP ranks other than rank zero run the run too,
    and write nothing into its folder.
    """

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
        if self.claims is None:
            return self
        self.claims.__enter__()
        try:
            self._acquire()
        except BaseException:
            self.claims.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.claims is not None:
            self.claims.close()

    def _acquire(self) -> None:
        assert self.claims is not None
        deadline = None
        while not self.claims.try_claim(self.UNIT):
            holder = self.claims.holder(self.UNIT)
            if holder is None:
                continue  # released meanwhile: try again
            same_machine = holder.host == self.claims.host and holder.machine == self.claims.machine
            if same_machine or (deadline is not None and time.monotonic() > deadline):
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.started))
                raise RunInUseError(
                    f"run directory {self.run_dir} is in use by another run ({holder}, "
                    f"started {started}; "
                    f"lock {holder.path}): wait for it to end, or choose another hydra.run.dir"
                )
            if deadline is None:  # another host: alive, or dead and not yet silent long enough
                deadline = time.monotonic() + self.config.expiry_s + self.config.heartbeat_s
                log.warning(
                    "run directory %s is locked by %s on another host; waiting up to %.0f s to "
                    "see whether that run is dead (%s)",
                    self.run_dir,
                    holder,
                    self.config.expiry_s + self.config.heartbeat_s,
                    holder.path,
                )
            time.sleep(self.config.poll_s)

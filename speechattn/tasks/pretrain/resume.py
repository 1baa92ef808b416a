"""Resuming a pretraining run: which checkpoint `ckpt_path=last` means, whether it may continue
under today's settings, and the lock that keeps one run per run directory.

- `newest_checkpoint`: Lightning names a checkpoint `last-v1.ckpt` (`step=...-v1.ckpt`) when
  the name is taken by a file it does not think is its own, e.g. in a copied or moved run
  directory (the checkpoint remembers the old folder). `last.ckpt` then stays behind while
  training goes on, so `ckpt_path=last` means the checkpoint with the highest step, whatever
  its name (the trainer also writes without the version counter, `build_trainer`).
- `resume_differences`: a checkpoint continues only the run it came from. Lightning would load
  its weights into another architecture wherever the shapes allow (`num_heads=4` against 8
  heads), keep its optimiser state under another optimiser's settings, and the metadata would
  state the new settings as what trained. Differences are refused, listed, unless each is named
  in `allow_resume_changes`: then it is recorded (`resume_changes` in the checkpoints and in
  upstream.pt's metadata) and takes effect from the resume on (`PretrainTask.on_load_checkpoint`
  puts new optimiser values into the restored optimiser state).
- `RunLock`: two runs writing one run directory interleave metrics.csv, checkpoints and
  config.yaml. A claim file (`speechattn.data.claims`, heartbeat and take-over of dead holders)
  held for the whole run refuses a second run while the first lives.
"""

from __future__ import annotations

import logging
import re
import shlex
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from speechattn.data.claims import ClaimConfig, Claims, read_claim
from speechattn.errors import ConfigError, SpeechattnError
from speechattn.model.serialization import TorchFileError

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
    none. An unreadable `last*.ckpt` is returned as it stands: the resume then stops with an
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


# ----------------------------------------------------------------------------- may it continue

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
    changes = [
        {"step": step, "setting": k, "checkpoint": old, "now": new}
        for k, (old, new) in differences.items()
    ]
    for change in changes:
        log.warning(
            "resuming with %s changed from %r to %r at step %d (allow_resume_changes; recorded "
            "in upstream.pt's metadata as resume_changes)",
            change["setting"],
            change["checkpoint"],
            change["now"],
            step,
        )
    return changes


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


# ----------------------------------------------------------------------------- the run's lock


class RunInUseError(SpeechattnError):
    """Another live run writes the same run directory."""


class RunLockLost(SpeechattnError, RuntimeError):
    """This run's lock passed to another run while this one was silent: it writes no more."""


class RunLock:
    """`<run dir>/run.claim` held for a whole run (`with RunLock(dir): ...`).

    A claim of a process of this machine holds while that process exists, however long it is
    silent (a stopped run is not dead), and is taken over at once when it is gone (logged);
    one of another host is dead once it has missed its heartbeats for `config.expiry_s`: a
    requeued job that lands on another node within that time waits for it (logged), a live run
    keeps it fresh and the second run is refused with `RunInUseError` naming the holder. A run
    of another host that was silent that long and lost its lock finds out at its next write
    (`check`, fencing by the claim's token) and stops with `RunLockLost`.
    """

    UNIT = "run"

    def __init__(self, run_dir: Path, config: ClaimConfig | None = None) -> None:
        self.run_dir = run_dir
        self.config = config or ClaimConfig()
        self.claims = Claims(run_dir, self.config, pid_holds=True)

    def check(self) -> None:
        """Raise `RunLockLost` naming the new holder unless the run directory's claim is still
        this run's (read now, by token: the heartbeat may not have run since a long pause)."""
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

    def __enter__(self) -> RunLock:
        self.claims.__enter__()
        try:
            self._acquire()
        except BaseException:
            self.claims.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.claims.close()

    def _acquire(self) -> None:
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


class RunLockGuard(L.Callback):
    """`RunLock.check` before the run writes into its folder: a metrics row, a validation's
    row, a checkpoint (Lightning calls `on_save_checkpoint` before the file is written)."""

    def __init__(self, lock: RunLock) -> None:
        self.lock = lock

    def _check(self, *args: Any) -> None:
        self.lock.check()

    on_train_batch_end = on_validation_end = on_save_checkpoint = _check

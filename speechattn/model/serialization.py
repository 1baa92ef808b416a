"""Reading torch files we did not necessarily write: upstreams, Lightning checkpoints, probes.

Every `.pt` / `.ckpt` goes through `load_torch_file`, which unpickles with `weights_only=True`:
only tensors, plain containers and numbers are rebuilt, so a crafted file whose pickle calls
`os.system` (or anything else) is refused before any of it runs. The checkpoints our runs write
(pretraining, downstream probes) hold nothing else (a test keeps it that way), so no extra
global is allow-listed; `SAFE_GLOBALS` is where one would go, after checking it cannot run code.

Failures raise `TorchFileError` naming the file and saying what is wrong in words (refused
pickle, truncated archive, not a torch file) instead of torch's raw reader message.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from speechattn.errors import SpeechattnError

# Globals a weights_only load may rebuild beyond torch's defaults. Empty: our checkpoints store
# hyper-parameters as plain dicts (never OmegaConf nodes) and paths as strings.
SAFE_GLOBALS: list[Callable[..., Any]] = []


class TorchFileError(SpeechattnError, ValueError):
    """A torch file is missing, truncated, corrupt, or holds objects we refuse to unpickle."""


def describe_load_error(error: BaseException, path: str | Path | None = None) -> str:
    """What went wrong reading the torch file `path`, in words (the raw message at the end)."""
    raw = str(error).strip().splitlines()
    first = raw[0][:200] if raw else type(error).__name__
    if isinstance(error, pickle.UnpicklingError) and "weights_only" in str(error).lower():
        culprit = next((ln.strip() for ln in raw if "GLOBAL" in ln), first)
        return (
            "refused to unpickle it: it contains Python objects that could run code, not only "
            f"tensors and plain values ({culprit[:160]}); nothing in it was executed"
        )
    # torch files are zip archives; a cut-off one has lost its central directory at the end
    if "zip archive" in first or (path is not None and not zipfile.is_zipfile(path)):
        return (
            "truncated or corrupt (not a complete torch zip archive; torch says "
            f"{type(error).__name__}: {first})"
        )
    return f"{type(error).__name__}: {first}"


def load_torch_file(
    path: str | Path, map_location: str | torch.device = "cpu", what: str = "torch file"
) -> Any:
    """`torch.load(path, weights_only=True)` with `SAFE_GLOBALS`; errors name the file.

    Raises `FileNotFoundError` when `path` does not exist and `TorchFileError` when it cannot be
    read safely (refused pickle, truncated or corrupt archive).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise TorchFileError(f"{what} {path}: {describe_load_error(e, path)}") from e


__all__ = ["SAFE_GLOBALS", "TorchFileError", "describe_load_error", "load_torch_file"]

"""Reading torch files we did not necessarily write: upstreams, Lightning checkpoints, probes.

Every `.pt` / `.ckpt` goes through `load_torch_file` (`weights_only=True`: a pickle that would
build anything but tensors, containers and numbers is refused before any of it runs; our own
checkpoints hold nothing else, a test keeps it so), and failures raise `TorchFileError` saying
in words what is wrong with the file.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from speechattn.errors import MissingFileError, SpeechattnError


class TorchFileError(SpeechattnError, ValueError):
    """A torch file is missing, truncated, corrupt, or holds objects we refuse to unpickle."""


def describe_load_error(error: BaseException, path: str | Path | None = None) -> str:
    """What went wrong reading the torch file `path`, in words (the raw message at the end)."""
    raw = str(error).strip().splitlines()
    first = raw[0][:200] if raw else type(error).__name__
    # A refused pickle names the class it would have built ("Unsupported global: GLOBAL x.Y");
    # random bytes fail otherwise ("Unsupported operand 69"): damaged, not dangerous.
    refused = next((ln.strip() for ln in raw if "GLOBAL" in ln), None)
    if isinstance(error, pickle.UnpicklingError) and refused is not None:
        return (
            "refused to unpickle it: it contains Python objects that could run code, not only "
            f"tensors and plain values ({refused[:160]}); nothing in it was executed"
        )
    if path is not None and not _looks_like_torch(path):
        return (
            "not a torch file: it is neither a torch zip archive nor a legacy torch pickle "
            "(damaged, or some other format); give the file torch.save wrote"
        )
    # torch files are zip archives; a cut-off one has lost its central directory at the end
    if "zip archive" in first or (path is not None and not zipfile.is_zipfile(path)):
        return (
            "truncated or corrupt (not a complete torch zip archive; torch says "
            f"{type(error).__name__}: {first})"
        )
    return f"{type(error).__name__}: {first}"


def _looks_like_torch(path: str | Path) -> bool:
    """True when the file opens as a torch file does: a zip archive's local header (b"PK\\3\\4",
    even when cut off later) or a pickle protocol 2+ header (torch's legacy format)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def load_torch_file(
    path: str | Path, map_location: str | torch.device = "cpu", what: str = "torch file"
) -> Any:
    """`torch.load(path, weights_only=True)`; `MissingFileError` (a FileNotFoundError) or
    `TorchFileError` (a folder, a refused pickle, not a complete torch file) name the file."""
    path = Path(path).expanduser()
    check_is_file(path, what)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise TorchFileError(f"{what} {path}: {describe_load_error(e, path)}") from e


def check_is_file(path: Path, what: str, error: type[TorchFileError] = TorchFileError) -> None:
    """`MissingFileError` when `path` does not exist, `error` when it is a folder (naming the
    .pt files inside, if any)."""
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.pt"))[:5]
        hint = f"; it holds {', '.join(inside)}" if inside else ""
        raise error(f"{what} {path} is a folder, not a file: give the .pt file{hint}")
    if not path.is_file():
        raise MissingFileError(f"{what} {path} does not exist")

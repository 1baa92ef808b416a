"""Small helpers every layer shares: padding masks, the ignored label id, device choice, atomic
writes, a progress bar and plain (JSON-friendly) copies of config values. It imports nothing
from the project but `speechattn.errors`, so every layer may use it (`tests/test_layering.py`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from speechattn.errors import DiskFullError, OutputExistsError

if TYPE_CHECKING:
    import torch
    from torch import Tensor

T = TypeVar("T")

IGNORE_INDEX = -100  # label id of padded / unlabelled frames (PyTorch's cross-entropy default)


def crop_lengths(batch: int, crop: int, generator: torch.Generator) -> Tensor:
    """(batch,) lengths as pretraining's random crops of LibriSpeech give them: 2/3 to all of
    `crop`, one utterance in five (the first included) at the crop. Benchmarks and the kernel
    tuner time padded batches shaped like this, since training batches are padded."""
    import torch

    lengths = torch.randint(2 * crop // 3, crop + 1, (batch,), generator=generator)
    lengths[::5] = crop
    return lengths


def lengths_to_padding_mask(lengths: Tensor, max_len: int | None = None) -> Tensor:
    """lengths (B,) -> (B, max_len or longest) bool, True at padded positions."""
    import torch

    T = int(lengths.max()) if max_len is None else int(max_len)
    return torch.arange(T, device=lengths.device)[None, :] >= lengths[:, None]


def plain(value: Any) -> Any:
    """Config values as plain Python for JSON and keyword arguments: OmegaConf nodes (resolved)
    and dataclasses -> dicts/lists, tensors -> lists, paths -> str; anything else as it is."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if type(value).__module__.startswith("omegaconf"):  # DictConfig / ListConfig
        from omegaconf import OmegaConf

        return plain(OmegaConf.to_container(value, resolve=True))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # tensors, numpy arrays
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    return value


def default_cache_root() -> Path:
    """`$SPEECHATTN_CACHE`, else `~/.cache/speechattn`: the root of every cache we write."""
    env = os.environ.get("SPEECHATTN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "speechattn"


def choose_device(name: str | torch.device = "auto") -> torch.device:
    """`auto`: CUDA when available, else CPU; any other name (`cpu`, `cuda:1`) as given."""
    import torch

    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from parts (stable across processes and Python versions, unlike hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def digest(obj: Any, lines: Iterable[str] = (), length: int = 16) -> str:
    """A cache key: hex sha256 of `obj` as canonical JSON (sorted keys; str() for other
    types), then of each of `lines`, cut to `length` digits. Both caches key with it."""
    h = hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode())
    for line in lines:
        h.update(line.encode())
    return h.hexdigest()[:length]


TEMP_MARK = ".tmp-"  # temporary names are `<name>.tmp-<pid>-<random>` beside the target


def temp_name(path: Path) -> Path:
    """A fresh temporary name beside `path` (same folder, so the rename is atomic)."""
    return path.with_name(f"{path.name}{TEMP_MARK}{os.getpid()}-{os.urandom(3).hex()}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """`with atomic_path(p) as tmp: write tmp`: renamed onto `p` when the block succeeds,
    removed when it fails, so readers see the old file or the whole new one, never half.
    Durable: `tmp` is fsynced before the rename and the folder after it, so a power loss never
    leaves the new name over unwritten blocks (a commit record written after its data never
    points at missing data). A full device (`out_of_space`), whatever wrote the file, raises
    `DiskFullError` naming `p`, its folder's free space and the fix."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            _fsync(tmp)
            os.replace(tmp, path)
            _fsync(path.parent, folder=True)
        except (OSError, RuntimeError) as e:
            if isinstance(e, DiskFullError) or not out_of_space(e):
                raise
            raise disk_full_error(path, e) from e
    finally:
        tmp.unlink(missing_ok=True)  # a failed write (full disk, crash) leaves nothing behind


def _fsync(path: Path, folder: bool = False) -> None:
    """Flush a file's (or a `folder`'s entries') pending writes to the device."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if folder:  # not every system opens folders (Windows): its renames are its own business
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise  # EIO: the bytes may not be on the device
        # a file system that cannot sync this (some network ones, folders): nothing to wait for
    finally:
        os.close(fd)


def out_of_space(error: BaseException) -> bool:
    """Whether `error` says a write ran out of space: ENOSPC or EDQUOT; NumPy's short write
    ("N requested and M written", no errno); torch's zip writer ("unexpected pos", "file write
    failed": its C++ `fwrite` came up short)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if isinstance(error, OSError):
        return "requested and" in text and "written" in text
    return "inline_container" in text and ("unexpected pos" in text or "write failed" in text)


def disk_full_error(path: Path, error: BaseException) -> DiskFullError:
    """The `DiskFullError` for writing `path` having failed with `error` (`out_of_space`)."""
    folder = path.parent
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free in {folder}"
    except OSError:
        free = f"free space in {folder} unknown"
    code = getattr(error, "errno", None)  # None for torch's zip writer's and NumPy's short writes
    cause = os.strerror(code) if code else "a write came up short"
    fix = "free space there or write to another disk"
    if str(folder.resolve()).startswith(str(Path(tempfile.gettempdir()).resolve())):
        fix += " (set TMPDIR to a folder on a larger disk)"
    return DiskFullError(
        f"{path}: cannot be written: the device is full or over quota ({free}; {cause}); {fix}",
        code or errno.ENOSPC,
    )


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary name and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """`with atomic_folder(d) as tmp: write files into tmp` (with `atomic_write_bytes`): the
    new folder replaces `d` whole when the block succeeds and is removed when it fails. The old
    folder first moves to a temporary name (a folder cannot be renamed over a non-empty one):
    a crash between the renames leaves no folder at `d`, never a partial one. Refuses a link."""
    path = Path(path)
    if path.is_symlink():
        raise link_error(path)
    tmp = temp_name(path)
    old: Path | None = None
    try:
        tmp.mkdir(parents=True)
        yield tmp
        _fsync(tmp, folder=True)
        if path.exists():
            old = temp_name(path)
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)  # the old folder back under its name
                old = None
                raise
        else:
            os.replace(tmp, path)
        _fsync(path.parent, folder=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def link_error(path: Path) -> OutputExistsError:
    """The error for a symbolic link where a run writes a file of its own."""
    return OutputExistsError(
        f"{path} is a symbolic link (to {os.readlink(path)}): a run writes its own files "
        "and never through a link, which could overwrite a file outside the run folder; "
        "remove the link or choose another folder"
    )


def append_text(path: str | Path, text: str) -> None:
    """Append `text` to `path` (created if missing), never through a symbolic link: the rows a
    run adds to a file it owns (an atomic rewrite per row would cost a sync each)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_error(path) from None
        raise
    with os.fdopen(fd, "a", newline="") as f:
        f.write(text)


def init_pool_worker() -> None:
    """Initialiser of our process pools' workers: one torch thread each, and the default
    action for stop signals (inherited, the training's flag-setting handler would keep
    `Pool.terminate()` from ending them)."""
    import torch

    torch.set_num_threads(1)
    for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)


@contextmanager
def progress_bar(
    total: int | None, description: str, enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """`with progress_bar(n, "extracting") as advance: ... advance()`: a rich bar with a count,
    elapsed and remaining time; a no-op when disabled (or when `total` is 0)."""
    if not enabled or total == 0:
        yield lambda steps=1: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(TextColumn("{task.description}"), *columns, transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda steps=1: progress.advance(task, steps)


def track(
    items: Iterable[T], description: str, total: int | None = None, enabled: bool = True
) -> Iterator[T]:
    """Iterate `items` under `progress_bar` (total: `len(items)` when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with progress_bar(total, description, enabled) as advance:
        for item in items:
            yield item
            advance(1)

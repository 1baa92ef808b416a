"""The errors speechattn raises on purpose, and how a command line reports them (policy:
docs/errors.md). Subclasses keep `ValueError`, `FileNotFoundError` or `RuntimeError` as a second
base where callers already catch those; checks of the Python API's own contract (a tensor of the
wrong shape) stay plain `ValueError`/`RuntimeError`: no command line causes them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

# Hydra's own switch for full tracebacks; every speechattn command honours it (docs/errors.md)
TRACEBACK_ENV = "HYDRA_FULL_ERROR"


class SpeechattnError(Exception):
    """Base of every error speechattn raises on purpose; its message names the problem and fix."""


class ConfigError(SpeechattnError, ValueError):
    """A setting that cannot work, e.g. `model.net.num_heads=0: must be a positive divisor of
    hidden_size=256`. The message names the setting, the value and what it must be."""


class DiskFullError(SpeechattnError, OSError):
    """A write that failed for lack of space (ENOSPC, EDQUOT, or a write cut short); the
    message names the file, the free space in its folder and the fix. An `OSError` with the
    original `errno`, so code that handles a full disk itself still recognises it."""

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno

    def __reduce__(self):  # picklable across worker processes
        return (type(self), (str(self), self.errno))


class MissingFileError(SpeechattnError, FileNotFoundError):
    """A file or folder the user named (an upstream, a checkpoint, a run dir) does not exist.
    The message names the path and the setting that gave it."""


class OutputExistsError(SpeechattnError, FileExistsError):
    """Where a command would write, something else already is (it is never overwritten);
    the message says what to remove or where else to write."""


class DependencyError(SpeechattnError, RuntimeError):
    """A library or program speechattn needs is missing or fails on this machine (eSpeak NG,
    an optional package); the message says what to install."""


def require(ok: bool, setting: str, value: object, rule: str) -> None:
    """Raise `ConfigError("<setting>=<value>: must be <rule>")` unless `ok`."""
    if not ok:
        raise ConfigError(f"{setting}={value!r}: must be {rule}")


def is_number(value: object) -> bool:
    """True for an int or float (not a bool, not a string such as "abc")."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    """True for an int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def traceback_requested() -> bool:
    """True when `HYDRA_FULL_ERROR=1` asks every command for full tracebacks."""
    return os.environ.get(TRACEBACK_ENV, "") == "1"


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """`--debug` on an argparse command: a SpeechattnError keeps its traceback."""
    text = f"show the traceback of an error (as {TRACEBACK_ENV}=1 does)"
    parser.add_argument("--debug", action="store_true", help=text)


@contextmanager
def command_line_errors(debug: bool = False, prog: str | None = None) -> Iterator[None]:
    """The argparse commands' `run_cli`: a SpeechattnError ends the process with one line on
    stderr (`prog: error: ...`) and exit status 1, or propagates with `debug` (`--debug`) or
    `HYDRA_FULL_ERROR=1`; a `UsageExit` prints its message the same way (status 2)."""
    name = prog or os.path.basename(sys.argv[0])
    try:
        yield
    except UsageExit as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        raise
    except SpeechattnError as e:
        if debug or traceback_requested():
            raise
        print(f"{name}: error: {one_line(e)}", file=sys.stderr)
        sys.exit(1)


class UsageExit(SystemExit):
    """Exit status 2 for a command line the parser accepted but the command cannot use (an
    unknown variant name, --jobs 0); `str()` is the message `command_line_errors` prints."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Refuse the command line as argparse does: the usage line on stderr, then `UsageExit`."""
    parser.print_usage(sys.stderr)
    raise UsageExit(message)


def one_line(error: BaseException) -> str:
    """`error`'s message on one line (a multi-line message is joined with ' | ')."""
    text = str(error).strip() or type(error).__name__
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())

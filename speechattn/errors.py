"""The errors speechattn raises on purpose.

`SpeechattnError` is the base of every error that means "the input or the settings are wrong,
and here is what to do": a damaged file, a value out of range, a diverged run. Entry points
(`run_cli`) turn exactly these into one line and exit status 1; anything else is a bug and
keeps its traceback. Subclasses keep `ValueError` (or `RuntimeError`) as a second base where
callers already catch those.
"""

from __future__ import annotations


class SpeechattnError(Exception):
    """Base of every error speechattn raises on purpose; its message names the problem and
    the fix."""


class ConfigError(SpeechattnError, ValueError):
    """A setting that cannot work, e.g. `model.net.num_heads=0: must be a positive divisor of
    hidden_size=256`. The message names the setting, the value and what it must be."""


class DiskFullError(SpeechattnError, OSError):
    """A write that failed for lack of space (ENOSPC, EDQUOT, or a write cut short), e.g.
    `/runs/x/upstream.pt: cannot be written: the device is full (12 MiB free in /runs/x) ...`.
    The message names the file, the folder, the free space there and the fix. An `OSError`
    with the original `errno`, so code that handles a full disk itself still recognises it."""

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno

    def __reduce__(self):  # picklable across worker processes
        return (DiskFullError, (str(self), self.errno))


def require(ok: bool, setting: str, value: object, rule: str) -> None:
    """Raise `ConfigError("<setting>=<value>: must be <rule>")` unless `ok`.

    The one shape of a start-up check, e.g.
    `require(heads > 0, "model.net.num_heads", heads, "a positive divisor of dim=256")`.
    """
    if not ok:
        raise ConfigError(f"{setting}={value!r}: must be {rule}")


def is_number(value: object) -> bool:
    """True for an int or float (not a bool, not a string such as "abc")."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    """True for an int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)

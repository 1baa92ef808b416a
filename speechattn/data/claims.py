"""Claims: processes on several hosts share out units of work (cache shards) in one folder;
`speechattn.data.workshare` drives them over a job. Settings and DDP use: docs/multinode.md.

A claim is `<claims_dir>/<unit>.claim`, created with O_CREAT|O_EXCL (atomic on local disks and
NFSv3+), holding the holder's host, pid, start time and a random token. A heartbeat thread
touches every claim its process holds each `heartbeat_s`. A claim untouched for `expiry_s`
(measured on the filesystem's clock, so node clock skew cannot expire live claims), or whose
process on this same host, kernel and pid namespace is gone, is dead, and exactly one other
process takes it over (`Claims._take_over`). `remove_stale_temps` deletes temporary files
(`utils.TEMP_MARK`) only where no live claim covers them, whatever host wrote them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speechattn.data.errors import DataError
from speechattn.errors import ConfigError
from speechattn.utils import TEMP_MARK, temp_name

log = logging.getLogger(__name__)


HOST_ENV = "SPEECHATTN_HOST"  # overrides socket.gethostname(): tests stand in for nodes with it
CLAIM_SUFFIX = ".claim"


def host_name() -> str:
    """This process's host identity in claims: `$SPEECHATTN_HOST`, else the host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def _machine() -> str:
    """This kernel's boot id and pid namespace ("" where unknown): processes sharing both see
    each other's pids, so there a missing pid is a dead holder."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this machine exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return pid > 0


@dataclass(frozen=True)
class ClaimConfig:
    """Timing of claims (the data layer's `data.claim_*` / `data.cache_wait_*` settings)."""

    heartbeat_s: float = 10.0  # a holder touches its claims this often
    # a claim untouched this long is a dead (or frozen) holder's: another process takes it over
    expiry_s: float = 120.0
    # give up (ClaimTimeout) when none of the units other processes hold finishes for this long
    wait_timeout_s: float = 1800.0
    log_every_s: float = 60.0  # a progress line this often while waiting for other processes
    poll_s: float = 2.0  # a waiting process looks at the claims again this often

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "expiry_s", "wait_timeout_s", "log_every_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"claim {name} must be > 0, found {getattr(self, name)}")
        if self.expiry_s < 3 * self.heartbeat_s:
            raise ConfigError(
                f"claim expiry_s ({self.expiry_s}) must be at least 3 x heartbeat_s "
                f"({self.heartbeat_s}): a holder that misses one heartbeat would lose its claims"
            )


@dataclass(frozen=True)
class ClaimInfo:
    """A claim file as read: what its holder wrote and the file's own state."""

    path: Path
    host: str  # "?" while the claim is being written (or when a crash left it empty)
    pid: int
    started: float  # Unix time the claim was made (holder's clock)
    token: str  # random, unique to one claim: tells "still ours" apart from "taken over"
    machine: str  # boot id / pid namespace of the holder ("" unknown)
    mtime: float  # last heartbeat (filesystem clock)
    inode: int

    def __str__(self) -> str:
        return f"{self.host} pid {self.pid}"


def read_claim(path: Path) -> ClaimInfo | None:
    """The claim at `path` (None: none). Opening, not stat, makes NFS fetch fresh attributes
    (close-to-open), so `mtime` is the server's current one."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    try:
        data: dict[str, Any] = json.loads(raw)
    except ValueError:  # created but not yet written, or its writer died in between
        data = {}
    return ClaimInfo(
        path=Path(path),
        host=str(data.get("host", "?")),
        pid=int(data.get("pid", 0)),
        started=float(data.get("started", 0.0)),
        token=str(data.get("token", "")),
        machine=str(data.get("machine", "")),
        mtime=st.st_mtime,
        inode=st.st_ino,
    )


class ClaimTimeout(DataError):
    """Units claimed by other, live processes made no progress within the wait timeout."""

    def __reduce__(self):  # keep the type across processes
        return (ClaimTimeout, (self.path, self.problem, self.detail, self.utt_id))


class Claims:
    """This process's claims in one folder; a context manager that runs the heartbeat.

        with Claims(folder, config) as claims:
            if claims.try_claim("shard-00003"):
                ...                                  # do it
                claims.release("shard-00003")

    Leaving the block releases every claim still held. Not thread-safe (bar its heartbeat).
    """

    def __init__(
        self,
        claims_dir: str | Path,
        config: ClaimConfig | None = None,
        host: str | None = None,
        pid_holds: bool = False,
    ) -> None:
        """`pid_holds`: a holder on this machine keeps its claims while its process exists,
        however long silent (`kill -STOP`): a lock never passed on while its holder may wake."""
        self.dir = Path(claims_dir)
        self.pid_holds = pid_holds
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = config or ClaimConfig()
        self.host = host or host_name()
        self.machine = _machine()
        self._held: dict[str, tuple[Path, str]] = {}  # unit -> (claim file, our token)
        self._lock = threading.Lock()  # guards _held against the heartbeat thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock: tuple[Path, int] | None = None  # (file, open descriptor), see now()

    def __enter__(self) -> Claims:
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name="claims-heartbeat", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the heartbeat, release every claim still held, remove the clock file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for unit in list(self._held):
            self.release(unit)
        if self._clock is not None:
            path, fd = self._clock
            os.close(fd)
            path.unlink(missing_ok=True)
            self._clock = None

    def path(self, unit: str) -> Path:
        if not unit or "/" in unit or unit in (".", ".."):
            raise ValueError(f"a unit name must be a plain file name, found {unit!r}")
        return self.dir / f"{unit}{CLAIM_SUFFIX}"

    def holder(self, unit: str) -> ClaimInfo | None:
        """Who claims `unit` now (None: nobody)."""
        return read_claim(self.path(unit))

    def holds(self, unit: str) -> bool:
        """Whether this process holds `unit` (False once the heartbeat found it taken over)."""
        with self._lock:
            return unit in self._held

    def now(self) -> float:
        """The shared filesystem's clock: the mtime of a file this process just touched."""
        if self._clock is None:
            path = temp_name(self.dir / ".clock")
            self._clock = (path, os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
        fd = self._clock[1]
        os.utime(fd)
        return os.fstat(fd).st_mtime

    def is_dead(self, info: ClaimInfo) -> bool:
        """Whether the holder cannot be working any more: silent for `expiry_s` (with
        `pid_holds`: on another host only), or a process of this machine that is gone."""
        same_machine = info.host == self.host and info.machine and info.machine == self.machine
        if self.pid_holds and same_machine and info.pid != os.getpid():
            return not pid_alive(info.pid)
        if self.now() - info.mtime > self.config.expiry_s:
            return True
        return bool(same_machine and info.pid != os.getpid() and not pid_alive(info.pid))

    def token(self, unit: str) -> str | None:
        """The token of this process's claim of `unit`, None when it holds none."""
        with self._lock:
            held = self._held.get(unit)
        return held[1] if held else None

    def live_holder(self, unit: str) -> ClaimInfo | None:
        """Who is working on `unit` now: None when its claim is absent or dead."""
        info = self.holder(unit)
        return None if info is None or self.is_dead(info) else info

    def try_claim(self, unit: str) -> bool:
        """Claim `unit`: True when it is now ours (free, or taken over from a dead holder),
        False when a live process holds it."""
        if self._thread is None:
            raise RuntimeError("claim inside `with Claims(...)`, which runs the heartbeat")
        path = self.path(unit)
        if self._create(unit, path):
            return True
        info = read_claim(path)
        if info is None:  # released between our attempt and the read: compete once more
            return self._create(unit, path)
        return self.is_dead(info) and self._take_over(unit, path, info)

    def release(self, unit: str) -> None:
        """Give `unit` up: its claim file is removed only if it is still ours."""
        with self._lock:
            entry = self._held.pop(unit, None)
        if entry is None:
            return
        path, token = entry
        info = read_claim(path)
        if info is not None and info.token == token:
            path.unlink(missing_ok=True)
        else:
            state = f"now claimed by {info}" if info else "removed"
            log.warning("%s: no longer ours at release (%s)", path, state)

    def _create(self, unit: str, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            return False
        token = secrets.token_hex(8)
        record = {
            "host": self.host,
            "pid": os.getpid(),
            "started": time.time(),
            "token": token,
            "machine": self.machine,
        }
        try:
            os.write(fd, json.dumps(record).encode())
        except BaseException:
            path.unlink(missing_ok=True)  # a claim we could not write (disk full) is no claim
            raise
        finally:
            os.close(fd)
        with self._lock:
            self._held[unit] = (path, token)
        return True

    def _take_over(self, unit: str, path: Path, dead: ClaimInfo) -> bool:
        """Replace the dead claim `dead` at `path`; exactly one of several racing processes wins:
        a rename moves one inode once. A later taker moves the winner's fresh claim instead,
        sees it is not the dead one (inode, token or age differ) and puts it back."""
        grave = temp_name(path)
        try:
            os.rename(path, grave)
        except FileNotFoundError:  # released, or moved by a faster taker: compete for it
            return self._create(unit, path)
        moved = read_claim(grave)
        if moved is None:  # our moved file was swept away meanwhile: compete for the free name
            return self._create(unit, path)
        if moved.inode == dead.inode and moved.token == dead.token and self.is_dead(moved):
            grave.unlink(missing_ok=True)
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(dead.started))
            log.warning(
                "%s: took over the claim of %s (started %s, silent for %.0f s)",
                path, dead, started, self.now() - dead.mtime,
            )  # fmt: skip
            return self._create(unit, path)
        try:  # a live claim: put it back, unless a new claim filled the name meanwhile
            os.link(grave, path)
        except FileExistsError:
            log.warning(
                "%s: the claim of %s was displaced; %s may be done twice", path, moved, unit
            )
        except OSError:  # a filesystem without hard links
            if not path.exists():
                os.replace(grave, path)
        finally:
            grave.unlink(missing_ok=True)
        return False

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            self._beat()

    def _beat(self) -> None:
        """Touch every claim still ours; drop (with a warning) the ones that are not."""
        with self._lock:
            held = list(self._held.items())
        for unit, (path, token) in held:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    try:
                        ours = json.loads(os.read(fd, 4096)).get("token") == token
                    except ValueError:
                        ours = False
                    if ours:
                        os.utime(fd)
                finally:
                    os.close(fd)
            except FileNotFoundError:
                self._lost(unit, token, "its claim file was removed")
                continue
            except OSError as e:  # a filesystem hiccup: try again at the next beat
                log.warning("%s: heartbeat failed (%s)", path, e)
                continue
            if not ours:
                self._lost(unit, token, "another process took its claim over")

    def _lost(self, unit: str, token: str, why: str) -> None:
        with self._lock:
            if self._held.get(unit, (None, None))[1] != token:
                return  # released meanwhile: nothing was lost
            del self._held[unit]
        log.warning(
            "%s: %s (this process was silent for over %.0f s?); it may be done twice",
            self.path(unit),
            why,
            self.config.expiry_s,
        )


def live_claim(
    claims_dir: str | Path, unit: str, config: ClaimConfig | None = None
) -> ClaimInfo | None:
    """`Claims.live_holder` for a process that claims nothing itself (`gc`)."""
    claims = Claims(claims_dir, config)
    try:
        return claims.live_holder(unit)
    finally:
        claims.close()


def remove_stale_temps(
    directory: str | Path,
    unit_of: Callable[[str], str | None],
    config: ClaimConfig | None = None,
    claims_dir: str | Path | None = None,
) -> list[Path]:
    """Delete the temporary files (`utils.atomic_path`) in `directory` that no live process can
    still be writing; returns their paths. `unit_of(target)` names a target file's unit, or
    None. A unit's files go when its claim (in `claims_dir`, default `directory`) is absent or
    dead, however fresh, and stay while it is live, however old; files of no unit go when
    untouched for `expiry_s`.
    """
    directory = Path(directory)
    claims = Claims(claims_dir if claims_dir is not None else directory, config)
    removed = []
    try:  # listed before this process's own clock file exists
        for tmp in sorted(directory.glob(f"*{TEMP_MARK}*")):
            unit = unit_of(tmp.name.partition(TEMP_MARK)[0])
            if unit is None:
                try:
                    stale = claims.now() - tmp.stat().st_mtime > claims.config.expiry_s
                except FileNotFoundError:  # renamed into place meanwhile
                    continue
            else:
                stale = claims.live_holder(unit) is None
            if stale:
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
    finally:
        claims.close()
    if removed:
        log.info("removed %d stale temporary files in %s", len(removed), directory)
    return removed


__all__ = [
    "HOST_ENV",
    "ClaimConfig",
    "ClaimInfo",
    "ClaimTimeout",
    "Claims",
    "host_name",
    "live_claim",
    "read_claim",
    "remove_stale_temps",
]

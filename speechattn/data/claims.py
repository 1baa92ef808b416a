"""Claims: processes on several hosts share out units of work (cache shards) in one folder,
each unit done once, by whoever is free, the others waiting for the rest (`claim_pending`,
`claim_map`). A claim is `<unit>.claim`, created with O_CREAT|O_EXCL (atomic on local disks
and NFSv3+) and touched by its holder's heartbeat; a dead holder's claim is taken over by
exactly one other process. Design, settings and DDP use: docs/multinode.md.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from speechattn.data.errors import DataError
from speechattn.errors import ConfigError, SpeechattnError
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
    mtime: float  # last heartbeat (filesystem clock)
    inode: int
    host: str = "?"  # "?" while the claim is being written (or when a crash left it empty)
    pid: int = 0
    started: float = 0.0  # Unix time the claim was made (holder's clock)
    token: str = ""  # random, unique to one claim: tells "still ours" apart from "taken over"
    machine: str = ""  # boot id / pid namespace of the holder ("" unknown)

    def __str__(self) -> str:
        return f"{self.host} pid {self.pid}"


_WRITTEN = {"host": str, "pid": int, "started": float, "token": str, "machine": str}


def _record(raw: bytes) -> dict[str, Any]:
    """What a claim file holds; {} while it is being written (or its writer died meanwhile)."""
    try:
        return json.loads(raw)
    except ValueError:
        return {}


def read_claim(path: Path) -> ClaimInfo | None:
    """The claim at `path` (None: none). Opening, not stat, makes NFS fetch fresh attributes
    (close-to-open), so `mtime` is the server's current one."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    data = _record(raw)
    written = {name: kind(data[name]) for name, kind in _WRITTEN.items() if name in data}
    return ClaimInfo(Path(path), st.st_mtime, st.st_ino, **written)


class ClaimTimeout(DataError):
    """Units claimed by other, live processes made no progress within the wait timeout."""


class Claims:
    """This process's claims in one folder (`try_claim`, `release`); a context manager that
    runs the heartbeat, and on leaving releases every claim still held. Not thread-safe (bar
    its heartbeat)."""

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
        self._held: dict[str, str] = {}  # unit -> the token of our claim
        self._lock = threading.Lock()  # guards _held against the heartbeat thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock: tuple[Path, int] | None = None  # (file, open descriptor), see now()

    def __enter__(self) -> Claims:
        self._thread = threading.Thread(
            target=self._heartbeat, name="claims-heartbeat", daemon=True
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
        return self.token(unit) is not None

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
        other = bool(same_machine and info.pid != os.getpid())  # another process we can see
        if self.pid_holds and other:
            return not pid_alive(info.pid)
        return (other and not pid_alive(info.pid)) or self.now() - info.mtime > self.config.expiry_s

    def token(self, unit: str) -> str | None:
        """The token of this process's claim of `unit`, None when it holds none."""
        with self._lock:
            return self._held.get(unit)

    def live_holder(self, unit: str) -> ClaimInfo | None:
        """Who is working on `unit` now: None when its claim is absent or dead."""
        info = self.holder(unit)
        return None if info is None or self.is_dead(info) else info

    def try_claim(self, unit: str) -> bool:
        """Claim `unit`: True when it is now ours (free, or taken over from a dead holder),
        False when a live process holds it."""
        if self._thread is None:
            raise RuntimeError("claim inside `with Claims(...)`, which runs the heartbeat")
        if self._create(unit):
            return True
        info = self.holder(unit)
        if info is None:  # released between our attempt and the read: compete once more
            return self._create(unit)
        return self.is_dead(info) and self._take_over(unit, info)

    def release(self, unit: str) -> None:
        """Give `unit` up: its claim file is removed only if it is still ours."""
        with self._lock:
            token = self._held.pop(unit, None)
        if token is None:
            return
        path = self.path(unit)
        info = read_claim(path)
        if info is not None and info.token == token:
            path.unlink(missing_ok=True)
        else:
            state = f"now claimed by {info}" if info else "removed"
            log.warning("%s: no longer ours at release (%s)", path, state)

    def _create(self, unit: str) -> bool:
        path = self.path(unit)
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
            self._held[unit] = token
        return True

    def _take_over(self, unit: str, dead: ClaimInfo) -> bool:
        """Replace the dead claim `dead` of `unit`; exactly one of several racing processes wins:
        a rename moves one inode once. A later taker moves the winner's fresh claim instead,
        sees it is not the dead one (inode, token or age differ) and puts it back."""
        path = dead.path
        grave = temp_name(path)
        try:
            os.rename(path, grave)
        except FileNotFoundError:  # released, or moved by a faster taker: compete for it
            return self._create(unit)
        moved = read_claim(grave)
        if moved is None:  # our moved file was swept away meanwhile: compete for the free name
            return self._create(unit)
        if moved.inode == dead.inode and moved.token == dead.token and self.is_dead(moved):
            grave.unlink(missing_ok=True)
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(dead.started))
            log.warning(
                "%s: took over the claim of %s (started %s, silent for %.0f s)",
                path,
                dead,
                started,
                self.now() - dead.mtime,
            )
            return self._create(unit)
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

    def _heartbeat(self) -> None:
        """Every `heartbeat_s`, touch each claim still ours; drop (with a warning) the others."""
        while not self._stop.wait(self.config.heartbeat_s):
            with self._lock:
                held = list(self._held.items())
            for unit, token in held:
                self._beat(unit, token)

    def _beat(self, unit: str, token: str) -> None:
        """Touch our claim of `unit`; forget it (with a warning) when it is ours no more."""
        path = self.path(unit)
        try:
            with open(path, "rb") as f:  # the file read is the one touched
                if _record(f.read(4096)).get("token") == token:
                    os.utime(f.fileno())
                    return
            why = "another process took its claim over"
        except FileNotFoundError:
            why = "its claim file was removed"
        except OSError as e:  # a filesystem hiccup: try again at the next beat
            log.warning("%s: heartbeat failed (%s)", path, e)
            return
        with self._lock:
            if self._held.get(unit) != token:
                return  # released meanwhile: nothing was lost
            del self._held[unit]
        log.warning(
            "%s: %s (this process was silent for over %.0f s?); it may be done twice",
            path,
            why,
            self.config.expiry_s,
        )


def remove_stale_temps(
    directory: str | Path,
    unit_of: Callable[[str], str | None],
    config: ClaimConfig | None = None,
) -> list[Path]:
    """Delete (and return) the temporary files in `directory` no live process can still be
    writing: a unit's (`unit_of(target)`, None for none) when its claim is absent or dead,
    however fresh; those of no unit when untouched for `expiry_s`."""
    directory = Path(directory)
    removed = []
    with closing(Claims(directory, config)) as claims:  # listed before its clock file exists
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
    if removed:
        log.info("removed %d stale temporary files in %s", len(removed), directory)
    return removed


T = TypeVar("T")
R = TypeVar("R")


class WorkerDied(SpeechattnError, RuntimeError):
    """A pool's worker process ended without a result (a signal, the out-of-memory killer)."""


class WorkShare(Claims):
    """One process's share of a job over `claims_dir`: which of `units` it may do next
    (`claim`, then `finished` for each), then the wait for the units others hold (`wait`)."""

    def __init__(
        self,
        units: Iterable[str],
        claims_dir: str | Path,
        is_done: Callable[[str], bool],
        config: ClaimConfig | None = None,
        what: str = "units",
        host: str | None = None,
    ) -> None:
        units = list(units)
        if len(set(units)) != len(units):
            raise ValueError(f"{what}: unit names must be unique")
        super().__init__(claims_dir, config, host)
        self.is_done, self.what = is_done, what
        self._queue = deque(units)  # still to look at, in order
        self._waiting: list[str] = []  # others held them when last looked at
        self._last_progress = self._last_log = time.monotonic()

    def claim(self, n: int) -> list[str]:
        """Up to `n` units claimed for this process, in order ([] when none is free now)."""
        batch: list[str] = []
        while self._queue and len(batch) < n:
            unit = self._queue.popleft()
            if self.is_done(unit):
                continue
            if not self.try_claim(unit):
                self._waiting.append(unit)
            elif self.is_done(unit):  # its previous holder finished it just before we claimed
                self.release(unit)
            else:
                batch.append(unit)
        return batch

    def finished(self, unit: str) -> None:
        """Release `unit`, done here (RuntimeError when `is_done` says it is not: work that
        ends without its commit would be lost silently)."""
        if not self.is_done(unit):
            raise RuntimeError(
                f"{unit} ({self.what}) was handed out, but is_done({unit!r}) is still False "
                "when the next ones are asked for: the work must finish it"
            )
        self.release(unit)
        self._last_progress = time.monotonic()

    def wait(self) -> bool:
        """Call when this process holds nothing and `claim` found nothing: False when every
        unit is done; else sleeps `poll_s`, queues the units others held for another look and
        returns True (`ClaimTimeout` when none of them finished for `wait_timeout_s`)."""
        still = [unit for unit in self._waiting if not self.is_done(unit)]
        if not still and not self._queue:
            return False
        now = time.monotonic()
        if len(still) < len(self._waiting):
            self._last_progress = now
        self._waiting = []
        config, idle = self.config, now - self._last_progress
        if idle > config.wait_timeout_s:
            raise self._timeout(still, idle)
        if now - self._last_log >= config.log_every_s:
            log.info(
                "waiting for %d %s claimed by other processes: %s; none finished for "
                "%.0f s (gives up after %.0f s)",
                len(still),
                self.what,
                self._by_holder(still),
                idle,
                config.wait_timeout_s,
            )
            self._last_log = now
        time.sleep(config.poll_s)
        self._queue.extend(still)
        return True

    def _by_holder(self, units: list[str], shown: int = 5) -> str:
        """'node7 pid 1234 (shard-00005, shard-00007), node3 pid 99 (shard-00010)'."""
        groups: dict[str, list[str]] = {}
        for unit in units:
            info = self.holder(unit)
            groups.setdefault(str(info) if info else "released, not done", []).append(unit)
        parts = []
        for holder, names in groups.items():
            more = f", ... {len(names) - shown} more" if len(names) > shown else ""
            parts.append(f"{holder} ({', '.join(names[:shown])}{more})")
        return ", ".join(parts)

    def _timeout(self, units: list[str], waited: float) -> ClaimTimeout:
        lines = []
        for unit in units[:10]:
            if (info := self.holder(unit)) is None:
                lines.append(f"{unit} (claim released, not done)")
                continue
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.started))
            lines.append(
                f"{unit} (claimed by {info} since {started}, last heartbeat "
                f"{self.now() - info.mtime:.0f} s ago; claim file {info.path})"
            )
        if len(units) > 10:
            lines.append(f"... {len(units) - 10} more")
        return ClaimTimeout(
            self.path(units[0]),
            f"timed out waiting for {self.what} claimed by other processes",
            f"{len(units)} {self.what} unfinished and none done for {waited:.0f} s: "
            + "; ".join(lines)
            + ". Their holders still heartbeat but finish nothing: check those processes, or "
            "raise data.cache_wait_timeout_s; deleting a claim file frees its unit for the next "
            "process that looks",
        )


def claim_pending(
    units: Iterable[str],
    claims_dir: str | Path,
    is_done: Callable[[str], bool],
    config: ClaimConfig | None = None,
    what: str = "units",
    host: str | None = None,
) -> Iterator[str]:
    """Share `units` with every other process running this over the same `claims_dir`:
    `for unit in claim_pending(...): do(unit)` yields the units claimed here, in order, skipping
    those `is_done` or held by others; each must be done (else RuntimeError) before the next is
    asked for. Then waits until every unit is done (`WorkShare.wait`), yielding a unit released
    undone or whose holder died."""
    with WorkShare(units, claims_dir, is_done, config, what, host) as share:
        while (claimed := share.claim(1)) or share.wait():
            for unit in claimed:
                yield unit
                share.finished(unit)


def claim_map(
    fn: Callable[[T], R],
    items: Mapping[str, T],
    claims_dir: str | Path,
    is_done: Callable[[str], bool],
    pool: ProcessPoolExecutor | None = None,
    workers: int = 1,
    config: ClaimConfig | None = None,
    what: str = "units",
    host: str | None = None,
) -> Iterator[tuple[str, R]]:
    """`claim_pending` over `items`' keys, running `fn(items[unit])` (which must make
    `is_done(unit)` true), yielding `(unit, result)` in completion order. With a `pool` (made
    first: it forks before the heartbeat thread starts) `workers` units run at a time, else `fn`
    runs here. Consume in one thread. A failure of `fn` is raised once the claims still held
    are released (end the pool); a worker process that died, as `WorkerDied`."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, found {workers}")
    submit, slots = (_run_here, 1) if pool is None else (pool.submit, workers)
    running: dict[Future, str] = {}  # unit of each future
    with WorkShare(items, claims_dir, is_done, config, what, host) as share:
        while (claimed := share.claim(slots - len(running))) or running or share.wait():
            for unit in claimed:
                try:
                    running[submit(fn, items[unit])] = unit
                except BrokenProcessPool as error:  # a worker died since the last result
                    raise _worker_died(unit, what) from error
            done, _ = wait(running, return_when=FIRST_COMPLETED)  # at once if none runs
            for future in done:
                unit = running.pop(future)
                try:
                    value = future.result()
                except BrokenProcessPool as error:
                    raise _worker_died(unit, what) from error
                share.finished(unit)
                yield unit, value


def _run_here(fn: Callable[[T], R], item: T) -> Future:
    """`fn(item)` run in this process, as a finished future (its failure raised at once)."""
    future: Future = Future()
    future.set_result(fn(item))
    return future


def _worker_died(unit: str, what: str) -> WorkerDied:
    return WorkerDied(
        f"a worker process died while working on {what} ({unit} among them), killed by a "
        "signal or out of memory; nothing it left half-done is used: run again to resume"
    )

"""Sharing a job's units of work between processes through claims (`speechattn.data.claims`):
each unit gets done once, by whoever is free, and the others wait for the rest.

    done = lambda shard: (entry / f"{shard}.json").is_file()     # the unit's commit marker
    for shard in claim_pending(names, entry, done, what="shards"):
        extract(shard)                       # atomic writes, the marker last

`claim_map` keeps a process pool busy the same way; `claim_batches` hands out lists of units.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from pathlib import Path
from typing import Any, TypeVar

from speechattn.data.claims import ClaimConfig, Claims, ClaimTimeout
from speechattn.errors import SpeechattnError

log = logging.getLogger("speechattn.data.claims")  # one logger for the claims' progress lines

T = TypeVar("T")
R = TypeVar("R")


class WorkerDied(SpeechattnError, RuntimeError):
    """A pool's worker process ended without a result (a signal, the out-of-memory killer)."""


class WorkShare:
    """One process's share of a job over `claims_dir`: which of `units` it may do next, then
    the wait for the units others hold; a context manager (it runs the claims' heartbeat).

        with WorkShare(units, folder, is_done, config) as share:
            while True:
                batch = share.claim(n)        # up to n units: nobody finished or holds them
                for unit in batch:
                    do(unit)
                    share.finished(unit)      # is_done(unit) must now be True: released
                if not batch and not share.wait():
                    break                     # every unit is done, by someone

    Not thread-safe.
    """

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
        self.config = config or ClaimConfig()
        self.claims = Claims(claims_dir, self.config, host)
        self.is_done = is_done
        self.what = what
        self._queue = deque(units)  # still to look at, in order
        self._waiting: list[str] = []  # others held them when last looked at
        self._last_progress = self._last_log = time.monotonic()

    def __enter__(self) -> WorkShare:
        self.claims.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.claims.close()  # releases what is still held: the next process may take it

    def claim(self, n: int) -> list[str]:
        """Up to `n` units claimed for this process, in order, neither done nor held by a live
        process ([] when none is free now)."""
        batch: list[str] = []
        while self._queue and len(batch) < n:
            unit = self._queue.popleft()
            if self.is_done(unit):
                continue
            if not self.claims.try_claim(unit):
                self._waiting.append(unit)
            elif self.is_done(unit):  # its previous holder finished it just before we claimed
                self.claims.release(unit)
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
        self.claims.release(unit)
        self._last_progress = time.monotonic()

    def wait(self) -> bool:
        """Call when this process holds nothing and `claim` found nothing: False when every
        unit is done; else sleeps `poll_s`, queues the units others held for another look and
        returns True. Logs the holders every `log_every_s`; `ClaimTimeout` when none of their
        units finished for `wait_timeout_s`."""
        still = [unit for unit in self._waiting if not self.is_done(unit)]
        if not still and not self._queue:
            return False
        now = time.monotonic()
        if len(still) < len(self._waiting):
            self._last_progress = now
        self._waiting = []
        config = self.config
        if now - self._last_progress > config.wait_timeout_s:
            raise _timeout(self.claims, still, self.what, now - self._last_progress)
        if now - self._last_log >= config.log_every_s:
            log.info(
                "waiting for %d %s claimed by other processes: %s; none finished for "
                "%.0f s (gives up after %.0f s)", len(still), self.what,
                _by_holder(self.claims, still), now - self._last_progress, config.wait_timeout_s,
            )  # fmt: skip
            self._last_log = now
        time.sleep(config.poll_s)
        self._queue.extend(still)
        return True


def claim_batches(
    units: Iterable[str],
    claims_dir: str | Path,
    is_done: Callable[[str], bool],
    size: int,
    config: ClaimConfig | None = None,
    what: str = "units",
    host: str | None = None,
) -> Iterator[list[str]]:
    """Share `units` with every other process running this over the same `claims_dir`.

    Yields lists of up to `size` units claimed here, in order, skipping those `is_done` or held
    by others. Each must be done (else RuntimeError) before the next list is asked for; then
    its claim is released. With nothing left to claim, waits until every unit is done
    (`WorkShare.wait`); a unit released undone, or whose holder died, is yielded here. Claims
    still held when the caller stops are released.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, found {size}")
    with WorkShare(units, claims_dir, is_done, config, what, host) as share:
        while True:
            batch = share.claim(size)
            if batch:
                yield list(batch)
                for unit in batch:
                    share.finished(unit)
            elif not share.wait():
                return


def claim_pending(
    units: Iterable[str],
    claims_dir: str | Path,
    is_done: Callable[[str], bool],
    config: ClaimConfig | None = None,
    what: str = "units",
    host: str | None = None,
) -> Iterator[str]:
    """`claim_batches` one unit at a time: `for unit in claim_pending(...): do(unit)`."""
    with closing(claim_batches(units, claims_dir, is_done, 1, config, what, host)) as batches:
        for (unit,) in batches:
            yield unit


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
    """`fn(items[unit])` for each unit (`items`' keys, in order) that no other process running
    this over `claims_dir` did or does, yielding `(unit, result)` in completion order; then
    waits for the units others hold, as `claim_batches` does.

    `fn` must make `is_done(unit)` true before it returns. With a `pool`, `workers` units run
    at a time, a new one claimed as each finishes; without, `fn` runs here. Create the pool
    first (it forks before the heartbeat thread starts) and consume this in one thread. A
    failure of `fn` is raised after the claims still held are released (end the pool).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, found {workers}")
    # (unit, its future from the pool, or None and the result computed here)
    arrived: queue.SimpleQueue[tuple[str, Future | None, Any]] = queue.SimpleQueue()
    running = 0
    with WorkShare(items, claims_dir, is_done, config, what, host) as share:
        while True:
            for unit in share.claim((workers if pool is not None else 1) - running):
                running += 1
                if pool is None:
                    arrived.put((unit, None, fn(items[unit])))
                    continue
                try:
                    future = pool.submit(fn, items[unit])
                except BrokenProcessPool as error:  # a worker died since the last result
                    raise _worker_error(error, unit, what) from error
                future.add_done_callback(lambda f, unit=unit: arrived.put((unit, f, None)))
            if running:
                unit, future, value = arrived.get()  # the pool's callbacks put them
                running -= 1
                if future is not None:
                    if future.exception() is not None:
                        raise _worker_error(future.exception(), unit, what)
                    value = future.result()
                share.finished(unit)
                yield unit, value
            elif not share.wait():
                return


def _worker_error(error: BaseException, unit: str, what: str) -> BaseException:
    """A worker's own exception as it is; a dead worker process as a `WorkerDied`."""
    if isinstance(error, BrokenProcessPool):
        return WorkerDied(
            f"a worker process died while working on {what} ({unit} among them), killed by a "
            "signal or out of memory; nothing it left half-done is used: run again to resume"
        )
    return error


def _by_holder(claims: Claims, units: list[str], shown: int = 5) -> str:
    """'node7 pid 1234 (shard-00005, shard-00007), node3 pid 99 (shard-00010)'."""
    groups: dict[str, list[str]] = {}
    for unit in units:
        info = claims.holder(unit)
        groups.setdefault(str(info) if info else "released, not done", []).append(unit)
    parts = []
    for holder, names in groups.items():
        more = f", ... {len(names) - shown} more" if len(names) > shown else ""
        parts.append(f"{holder} ({', '.join(names[:shown])}{more})")
    return ", ".join(parts)


def _timeout(claims: Claims, units: list[str], what: str, waited: float) -> ClaimTimeout:
    lines = []
    for unit in units[:10]:
        info = claims.holder(unit)
        if info is None:
            lines.append(f"{unit} (claim released, not done)")
            continue
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.started))
        lines.append(
            f"{unit} (claimed by {info} since {started}, last heartbeat "
            f"{claims.now() - info.mtime:.0f} s ago; claim file {info.path})"
        )
    if len(units) > 10:
        lines.append(f"... {len(units) - 10} more")
    return ClaimTimeout(
        claims.path(units[0]),
        f"timed out waiting for {what} claimed by other processes",
        f"{len(units)} {what} unfinished and none done for {waited:.0f} s: "
        + "; ".join(lines)
        + ". Their holders still heartbeat but finish nothing: check those processes, or "
        "raise data.cache_wait_timeout_s; deleting a claim file frees its unit for the next "
        "process that looks",
    )


__all__ = ["WorkShare", "claim_batches", "claim_map", "claim_pending"]

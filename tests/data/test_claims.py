"""Claims across hosts: processes with distinct fake host names (`SPEECHATTN_HOST`) share units
of work in one folder; each unit is done once, dead holders are taken over, live ones never, and
temporary files are removed only when no live claim covers them."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from speechattn.data.cache.shards import process_pool
from speechattn.data.claims import (
    HOST_ENV,
    ClaimConfig,
    Claims,
    ClaimTimeout,
    WorkerDied,
    claim_map,
    claim_pending,
    read_claim,
    remove_stale_temps,
)
from speechattn.utils import atomic_write_text, temp_name

FAST = ClaimConfig(heartbeat_s=0.05, expiry_s=0.4, wait_timeout_s=20, log_every_s=0.1, poll_s=0.02)
# where a live holder must keep its claim: a loaded machine can leave a process unscheduled for
# longer than FAST's expiry, and its claim would then be taken over by right
LIVE = ClaimConfig(heartbeat_s=0.05, expiry_s=2.0, wait_timeout_s=60, log_every_s=0.1, poll_s=0.02)
# where expiry plays no part (every claim is live or long dead)
STEADY = dataclasses.replace(LIVE, expiry_s=120.0)
DEADLINE_S = 60  # for what takes milliseconds: only a hang comes near it
CTX = mp.get_context("fork")  # test functions are not importable by a spawned child


def _done(folder: Path):
    return lambda unit: (folder / f"{unit}.txt").is_file()


def _unit_of(target: str) -> str | None:
    """u3.txt -> u3; files of no unit (index.json) -> None."""
    return target.split(".")[0] if target.startswith("u") else None


def _work(folder: Path, unit: str, host: str) -> None:
    """The unit's work: a log line (counts how often it was done), then the file marking it done."""
    with open(folder / "work.log", "a") as f:
        f.write(f"{unit} {host} {os.getpid()}\n")
    atomic_write_text(folder / f"{unit}.txt", f"{unit} by {host}\n")


def _node(host: str, folder: Path, units: list[str], start, seconds: float) -> None:
    os.environ[HOST_ENV] = host
    start.wait(DEADLINE_S)
    for unit in claim_pending(units, folder, _done(folder), STEADY, "units"):
        time.sleep(seconds)
        _work(folder, unit, host)


def _ghost_claim(path: Path) -> None:
    """A claim as a process of host "ghost" that died 1000 s ago left it."""
    path.write_text('{"host": "ghost", "pid": 4242, "started": 0, "token": "ghost"}')
    os.utime(path, (time.time() - 1000,) * 2)


def _log(folder: Path) -> list[list[str]]:
    return [line.split() for line in (folder / "work.log").read_text().splitlines()]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".claim" in p.name or ".tmp-" in p.name)


def test_processes_on_distinct_hosts_do_every_unit_exactly_once(tmp_path):
    units = [f"u{i}" for i in range(24)]
    for unit in units[::5]:  # a crashed run's claims: every node finds them dead at once
        _ghost_claim(tmp_path / f"{unit}.claim")
    start = CTX.Event()
    # 0.1 s a unit: one node alone would take 2.4 s, while the others sat unscheduled
    nodes = [
        CTX.Process(target=_node, args=(f"node{i}", tmp_path, units, start, 0.1)) for i in range(4)
    ]
    for p in nodes:
        p.start()
    start.set()
    for p in nodes:
        p.join(DEADLINE_S)
    assert [p.exitcode for p in nodes] == [0, 0, 0, 0]  # all returned, none raised
    log = _log(tmp_path)
    assert Counter(unit for unit, _, _ in log) == Counter(units)  # each once
    for unit, host, _ in log:
        assert (tmp_path / f"{unit}.txt").read_text() == f"{unit} by {host}\n"
    assert len({host for _, host, _ in log}) >= 2  # shared out, not one node doing everything
    assert _leftovers(tmp_path) == []  # claims released, clock files removed


def _hold(host, folder, unit, ready, finish_after, report, config=FAST) -> None:
    """A node that claims `unit`, starts writing its file, and (finish_after: None) never ends."""
    os.environ[HOST_ENV] = host
    with Claims(folder, config) as claims:
        assert claims.try_claim(unit)
        tmp = temp_name(folder / f"{unit}.txt")
        tmp.write_text("half")
        os.utime(tmp, (time.time() - 1000,) * 2)  # old: only the live claim protects it
        ready.set()
        if finish_after is None:
            time.sleep(60)
        time.sleep(finish_after)  # heartbeats keep the claim live meanwhile
        report.put(claims.holds(unit) and read_claim(claims.path(unit)) is not None)
        os.replace(tmp, folder / "ignored")
        _work(folder, unit, host)
        claims.release(unit)


def test_a_live_foreign_claim_is_never_taken_over_nor_its_temp_files_removed(tmp_path):
    ready, report = CTX.Event(), CTX.Queue()
    hold = 3 * LIVE.expiry_s + 0.5
    node9 = CTX.Process(target=_hold, args=("node9", tmp_path, "u1", ready, hold, report, LIVE))
    node9.start()
    assert ready.wait(DEADLINE_S)
    temp = next(tmp_path.glob("u1.txt.tmp-*"))
    assert remove_stale_temps(tmp_path, _unit_of, LIVE) == []
    assert temp.is_file()
    mine = []
    for unit in claim_pending(["u0", "u1", "u2"], tmp_path, _done(tmp_path), LIVE, host="nodeA"):
        mine.append(unit)
        _work(tmp_path, unit, "nodeA")
    node9.join(DEADLINE_S)
    assert mine == ["u0", "u2"]  # u1 waited for over 3 expiry periods, never taken
    assert report.get(timeout=5) is True  # node9 still held its claim when it finished
    assert node9.exitcode == 0
    assert (tmp_path / "u1.txt").read_text() == "u1 by node9\n"


def test_a_crashed_holder_is_taken_over_and_its_temp_files_removed(tmp_path, caplog):
    ready, report = CTX.Event(), CTX.Queue()
    dead = CTX.Process(target=_hold, args=("node-dead", tmp_path, "u1", ready, None, report))
    dead.start()
    assert ready.wait(DEADLINE_S)
    os.kill(dead.pid, signal.SIGKILL)  # no release: the claim file stays behind
    dead.join(DEADLINE_S)
    temp = next(tmp_path.glob("u1.txt.tmp-*"))
    # not yet expired (STEADY's expiry: FAST's could pass before this look on a loaded machine)
    assert remove_stale_temps(tmp_path, _unit_of, STEADY) == []
    time.sleep(FAST.expiry_s + 0.1)
    assert remove_stale_temps(tmp_path, _unit_of, FAST) == [temp]
    caplog.set_level(logging.WARNING, "speechattn.data.claims")
    mine = []
    for unit in claim_pending(["u0", "u1", "u2"], tmp_path, _done(tmp_path), FAST):
        mine.append(unit)
        _work(tmp_path, unit, "nodeA")
    assert mine == ["u0", "u1", "u2"]
    assert f"took over the claim of node-dead pid {dead.pid}" in caplog.text
    assert _leftovers(tmp_path) == []


def test_a_dead_process_of_this_host_is_taken_over_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv(HOST_ENV, "nodeA")
    patient = ClaimConfig(heartbeat_s=0.05, expiry_s=60)  # expiry plays no part here
    ready, report = CTX.Event(), CTX.Queue()
    dead = CTX.Process(target=_hold, args=("nodeA", tmp_path, "u1", ready, None, report))
    dead.start()
    assert ready.wait(DEADLINE_S)
    os.kill(dead.pid, signal.SIGKILL)
    dead.join(DEADLINE_S)
    with Claims(tmp_path, patient, host="nodeB") as other_host:
        assert not other_host.try_claim("u1")  # cannot see nodeA's pids: waits for expiry
    with Claims(tmp_path, patient) as same_host:
        assert same_host.try_claim("u1")  # fresh claim, but its pid is gone on this host


def test_of_two_processes_that_found_one_dead_claim_only_the_first_takes_it(tmp_path):
    _ghost_claim(tmp_path / "u0.claim")
    with Claims(tmp_path, FAST, host="nodeA") as a, Claims(tmp_path, FAST, host="nodeB") as b:
        dead = b.holder("u0")
        assert dead is not None and b.is_dead(dead)  # b's judgement, just before a acts
        assert a.try_claim("u0")
        assert not b._take_over("u0", dead)  # moves a's fresh claim: puts it back
        assert a.holds("u0") and not b.holds("u0")
        assert read_claim(a.path("u0")).host == "nodeA"
        names = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".clock")]
        assert names == ["u0.claim"]  # nothing left of b's move


def test_the_wait_logs_progress_then_times_out_naming_units_holders_and_claim_files(
    tmp_path, caplog
):
    caplog.set_level(logging.INFO, "speechattn.data.claims")
    # the wait outlasts the expiry, which outlasts any pause of node9's heartbeat
    config = dataclasses.replace(LIVE, wait_timeout_s=1.5 * LIVE.expiry_s, log_every_s=0.2)
    mine = []
    with Claims(tmp_path, config, host="node9") as node9:  # live: its heartbeat runs
        assert node9.try_claim("u1")
        with pytest.raises(ClaimTimeout) as error:
            for unit in claim_pending(["u0", "u1"], tmp_path, _done(tmp_path), config, "shards"):
                mine.append(unit)
                _work(tmp_path, unit, "nodeA")
        assert node9.holds("u1")  # waited past the expiry: never taken over
    message = str(error.value)
    claim = tmp_path / "u1.claim"
    assert message.startswith(f"{claim}: timed out waiting for shards claimed by other processes")
    assert f"u1 (claimed by node9 pid {os.getpid()} since " in message
    assert f"claim file {claim}" in message and "data.cache_wait_timeout_s" in message
    assert mine == ["u0"]
    assert f"waiting for 1 shards claimed by other processes: node9 pid {os.getpid()} (u1)" in (
        caplog.text
    )
    assert _leftovers(tmp_path) == []  # ours released, node9's released by its own exit


def test_a_unit_holds_its_claim_until_done(tmp_path):
    units = [f"u{i}" for i in range(7)]
    mine = []
    for unit in claim_pending(units, tmp_path, _done(tmp_path), FAST):
        assert sorted(p.name for p in tmp_path.glob("*.claim")) == [f"{unit}.claim"]
        mine.append(unit)
        _work(tmp_path, unit, "nodeA")
    assert mine == units
    assert _leftovers(tmp_path) == []


def _work_in_pool(job: tuple[Path, str]) -> str:
    folder, unit = job
    if unit == "u4":
        raise OSError("disk full")
    _work(folder, unit, "pool")
    return unit.upper()


def test_claim_map_runs_claimed_units_in_a_pool_and_a_failure_releases_the_claims(tmp_path):
    jobs = {f"u{i}": (tmp_path, f"u{i}") for i in range(6)}
    _work(tmp_path, "u1", "earlier")
    with process_pool(2) as pool:  # before claim_map: forked before the heartbeat thread
        ran = dict(claim_map(_work_in_pool, dict(list(jobs.items())[:4]), tmp_path,
                             _done(tmp_path), pool, workers=2, config=FAST))  # fmt: skip
    assert ran == {"u0": "U0", "u2": "U2", "u3": "U3"}  # u1 was done already
    with pytest.raises(OSError, match="disk full"), process_pool(2) as pool:
        for _ in claim_map(_work_in_pool, jobs, tmp_path, _done(tmp_path), pool, 2, FAST):
            pass
    assert not list(tmp_path.glob("*.claim"))  # released at once, not after the expiry
    inline = claim_map(_work_in_pool, {"u9": (tmp_path, "u9")}, tmp_path, _done(tmp_path))
    assert list(inline) == [("u9", "U9")]  # no pool: run here


def _die_on_u1(job: tuple[Path, str]) -> str:
    folder, unit = job
    if unit == "u1":
        os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
    time.sleep(0.2)
    _work(folder, unit, "pool")
    return unit


def test_a_worker_that_dies_ends_the_work_at_once_and_releases_its_claims(tmp_path):
    """A killed pool worker fails every pending unit at once (no wait for a result that will
    never come), with an error naming what happened; no claim outlives it."""
    jobs = {f"u{i}": (tmp_path, f"u{i}") for i in range(6)}
    start = time.monotonic()
    with pytest.raises(WorkerDied, match=r"a worker process died .*run again to resume"):
        with process_pool(2) as pool:
            for _ in claim_map(_die_on_u1, jobs, tmp_path, _done(tmp_path), pool, 2, FAST):
                pass
    assert time.monotonic() - start < 30  # promptly: multiprocessing.Pool waited forever
    assert not list(tmp_path.glob("*.claim"))


def test_a_pool_broken_before_the_next_unit_is_submitted_is_a_worker_death(tmp_path):
    """A worker that dies between two results (the pool already broken when the next unit is
    submitted) is reported as the dead worker it is, and no claim outlives it."""
    jobs = {f"u{i}": (tmp_path, f"u{i}") for i in range(6)}
    with pytest.raises(WorkerDied, match=r"a worker process died .*\(u\d among them\)"):
        with process_pool(2) as pool:
            for _ in claim_map(_work_in_pool, jobs, tmp_path, _done(tmp_path), pool, 1, FAST):
                # the out-of-memory killer. Process.kill, not os.kill(pid): once the first
                # worker is dead the pool's manager thread ends and reaps the other one, whose
                # pid may then be gone (ProcessLookupError) or another process's
                for worker in mp.active_children():
                    worker.kill()
                    worker.join()
                deadline = time.monotonic() + DEADLINE_S
                while not pool._broken and time.monotonic() < deadline:
                    time.sleep(0.01)  # the manager thread marks the pool broken
                assert pool._broken  # so the next unit's submit finds it broken
    assert not list(tmp_path.glob("*.claim"))


def test_done_units_are_skipped_and_undone_work_is_an_error(tmp_path):
    _work(tmp_path, "u1", "earlier")
    assert list(claim_pending(["u1"], tmp_path, _done(tmp_path), FAST)) == []
    with pytest.raises(RuntimeError, match=r"u0 \(units\) was handed out, but is_done\('u0'\)"):
        for _ in claim_pending(["u0", "u1"], tmp_path, _done(tmp_path), FAST):
            pass  # "work" that never marks the unit done
    assert _leftovers(tmp_path) == []


def test_a_unit_finished_between_the_check_and_the_claim_is_not_done_again(tmp_path):
    looks = Counter()

    def done_on_second_look(unit: str) -> bool:  # its holder commits, then releases, meanwhile
        looks[unit] += 1
        return looks[unit] > 1

    assert list(claim_pending(["u0"], tmp_path, done_on_second_look, FAST)) == []
    assert _leftovers(tmp_path) == []


def test_failed_work_releases_its_claim_for_the_next_process(tmp_path):
    with pytest.raises(OSError, match="disk full"):
        for _ in claim_pending(["u0"], tmp_path, _done(tmp_path), FAST):
            raise OSError("disk full")
    assert _leftovers(tmp_path) == []  # released at once, not after the expiry
    redone = []
    for unit in claim_pending(["u0"], tmp_path, _done(tmp_path), FAST):
        redone.append(unit)
        _work(tmp_path, unit, "nodeA")
    assert redone == ["u0"]


def test_release_never_removes_a_claim_that_is_no_longer_ours(tmp_path, caplog):
    with Claims(tmp_path, FAST, host="nodeA") as claims:
        assert claims.try_claim("u0")
        taken = temp_name(claims.path("u0"))
        taken.write_text('{"host": "nodeB", "pid": 7, "token": "theirs"}')
        os.replace(taken, claims.path("u0"))  # what a takeover leaves behind
        claims.release("u0")
    assert read_claim(tmp_path / "u0.claim").host == "nodeB"
    assert "no longer ours at release (now claimed by nodeB pid 7)" in caplog.text


def test_temp_files_of_no_unit_go_only_once_untouched_for_the_expiry(tmp_path):
    fresh, old = (temp_name(tmp_path / name) for name in ("index.json", "index.npz"))
    fresh.write_text("x")
    old.write_text("x")
    os.utime(old, (time.time() - 1000,) * 2)
    orphan = temp_name(tmp_path / "u3.npy")  # a unit nobody claims
    orphan.write_text("x")
    # STEADY's expiry: FAST's could pass between writing `fresh` and this look
    assert remove_stale_temps(tmp_path, _unit_of, STEADY) == sorted([old, orphan])
    assert fresh.is_file()


def test_expiry_must_leave_room_for_missed_heartbeats():
    with pytest.raises(ValueError, match=r"expiry_s \(20\) must be at least 3 x heartbeat_s"):
        ClaimConfig(heartbeat_s=10, expiry_s=20)
    with pytest.raises(ValueError, match="poll_s must be > 0"):
        ClaimConfig(poll_s=0)


def test_the_heartbeat_touches_its_claims_and_gives_up_those_no_longer_ours(tmp_path, caplog):
    with Claims(tmp_path, FAST, host="nodeA") as claims:
        assert claims.try_claim("u0") and claims.try_claim("u1") and claims.try_claim("u2")
        taken = temp_name(claims.path("u0"))
        taken.write_text('{"host": "nodeB", "pid": 7, "token": "theirs"}')
        os.replace(taken, claims.path("u0"))  # what a takeover leaves behind
        claims.path("u1").unlink()
        for unit in ("u0", "u2"):
            os.utime(claims.path(unit), (1000, 1000))
        deadline = time.monotonic() + DEADLINE_S  # the heartbeat thread's next beats
        while time.monotonic() < deadline and (
            claims.holds("u0") or claims.holds("u1") or claims.path("u2").stat().st_mtime == 1000
        ):
            time.sleep(FAST.heartbeat_s)
        assert not claims.holds("u0") and not claims.holds("u1") and claims.holds("u2")
        assert claims.path("u0").stat().st_mtime == 1000  # not ours: never touched
        assert claims.path("u2").stat().st_mtime > 1000
    assert "u0.claim: another process took its claim over" in caplog.text
    assert "u1.claim: its claim file was removed" in caplog.text
    assert read_claim(tmp_path / "u0.claim").host == "nodeB"

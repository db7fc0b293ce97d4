"""Whose exit it was, and whether it was a boot failure: a decision for every exit code.

A booted worker's exit is judged by what it said (its `exit` line), not by how soon it came:
the pooler test's worker leased a step of a run cancelled a moment later, lost its lease and
left with LEASE_LOST 0.98 s after its fork, which the old "any exit but OK or RECYCLE within a
second" rule logged as "failed to boot", backed off and counted toward the halt. A handler's
own exit (os._exit(3) in it) is the step's crash, never the worker's boot error.
"""

from __future__ import annotations

import signal

import pytest
from fakes import Harness, tok
from prometheus_client import generate_latest

from cyclone.child import channel
from cyclone.child.channel import ExitCode
from cyclone.states import ErrorKind
from cyclone.supervisor.arbiter import BOOT_BACKOFF, FAST_EXIT, MAX_BOOT_FAILURES
from cyclone.supervisor.children import ExitBy, ExitStatus, exit_by
from cyclone.supervisor.metrics import Metrics

SEGV = ExitStatus(signal=signal.SIGSEGV)
SOON = FAST_EXIT / 2  # well within the old rule's second

# A booted, idle worker that leaves on its own soon after its fork, saying why: boot failure?
BOOTED_IDLE = {
    ExitCode.OK: False,
    ExitCode.CRASHED: True,  # crashed before its first step: its schema is missing, say
    ExitCode.BOOT_ERROR: True,  # its database went away: back off
    ExitCode.LEASE_LOST: False,
    ExitCode.RECYCLE: False,
    ExitCode.STOPPED: False,
    ExitCode.ORPHANED: False,
}


def test_every_exit_code_is_decided() -> None:
    assert set(BOOTED_IDLE) == set(ExitCode)


def booted_worker(h: Harness) -> int:
    pid = h.started()[0]
    h.clock.advance(SOON)
    return pid


def failures_after(h: Harness, pid: int, code: int | None = None, status=None) -> int:
    if status is None:
        h.leave(pid, code)
    else:
        h.exit(pid, status)
    return h.arbiter.boot_failures


@pytest.mark.parametrize("code", list(ExitCode), ids=lambda c: c.name)
def test_a_booted_idle_workers_own_exit_soon_after_its_fork(h: Harness, code: ExitCode) -> None:
    pid = booted_worker(h)
    assert failures_after(h, pid, code) == int(BOOTED_IDLE[code])


@pytest.mark.parametrize("code", list(ExitCode), ids=lambda c: c.name)
def test_after_a_step_only_a_boot_error_is_a_boot_failure(h: Harness, code: ExitCode) -> None:
    pid = booted_worker(h)
    h.lease(pid)
    h.send(pid, channel.Done(step_id=7, outcome="completed", duration=0.1))
    assert failures_after(h, pid, code) == int(code is ExitCode.BOOT_ERROR)


@pytest.mark.parametrize("code", list(ExitCode), ids=lambda c: c.name)
def test_mid_step_only_a_boot_error_is_a_boot_failure(h: Harness, code: ExitCode) -> None:
    pid = booted_worker(h)
    h.lease(pid)
    assert failures_after(h, pid, code) == int(code is ExitCode.BOOT_ERROR)
    # Its own exit mid-step is the worker's, in the step's record too.
    (failed,) = h.store.failed
    assert failed[2] is ErrorKind.CRASHED
    assert failed[3] == f"worker process exited with {int(code)} ({code.name.lower()})"


def test_a_crash_before_any_step_but_after_fast_exit_is_not_a_boot_failure(h: Harness) -> None:
    pid = booted_worker(h)
    h.clock.advance(FAST_EXIT)
    assert failures_after(h, pid, ExitCode.CRASHED) == 0


def test_a_booted_worker_killed_by_a_signal_before_any_step_is_a_boot_failure(h: Harness) -> None:
    pid = booted_worker(h)
    assert failures_after(h, pid, status=SEGV) == 1


def test_a_booted_worker_killed_by_a_signal_mid_step_is_not(h: Harness) -> None:
    pid = booted_worker(h)
    h.lease(pid)
    assert failures_after(h, pid, status=SEGV) == 0
    assert h.store.failed == [(7, tok(7), ErrorKind.CRASHED, "worker process killed by SIGSEGV")]


@pytest.mark.parametrize(
    "status",
    [ExitStatus(code=ExitCode.BOOT_ERROR), ExitStatus(code=ExitCode.CRASHED), SEGV,
     ExitStatus(code=42)],
    ids=["boot_error", "crashed", "sigsegv", "42"],
)  # fmt: skip
def test_a_worker_that_never_said_ready_failed_to_boot(h: Harness, status: ExitStatus) -> None:
    h.arbiter.start()
    pid = h.workers()[0]
    h.clock.advance(FAST_EXIT * 10)  # however long it took
    assert failures_after(h, pid, status=status) == 1


@pytest.mark.parametrize("code", [ExitCode.LEASE_LOST, ExitCode.STOPPED, ExitCode.ORPHANED])
def test_lease_lost_orphaned_or_stopped_is_never_a_boot_failure_even_unbooted(
    h: Harness, code: ExitCode
) -> None:
    h.arbiter.start()
    assert failures_after(h, h.workers()[0], status=ExitStatus(code=code)) == 0


def test_the_pooler_flake_a_lease_lost_a_second_after_the_fork_respawns_at_once(
    h: Harness, caplog
) -> None:
    pid = booted_worker(h)  # forked at 25.710 ...
    h.lease(pid, kill_after=None)  # ... leased a step of a run cancelled a moment later ...
    h.clock.advance(0.4)
    h.leave(pid, ExitCode.LEASE_LOST)  # ... and left at 26.691: its lease was revoked
    assert "failed to boot" not in caplog.text
    assert h.arbiter.boot_failures == 0 and h.arbiter.next_spawn_at <= h.clock()
    assert len(h.workers()) == 2  # replaced at once, no backoff


@pytest.mark.parametrize("code", [3, 2, 0, 4])
def test_a_handlers_own_exit_is_the_steps_crash_not_the_workers(
    h: Harness, code: int, caplog
) -> None:
    pid = booted_worker(h)
    h.lease(pid)
    handle = h.arbiter.children[pid]
    assert exit_by(handle, ExitStatus(code=code)) is ExitBy.HANDLER  # nobody announced it
    h.exit(pid, ExitStatus(code=code))
    assert h.store.failed == [(
        7, tok(7), ErrorKind.CRASHED,
        f"handler called os._exit({code}) (or ended its process in a like way)",
    )]  # fmt: skip
    assert h.arbiter.boot_failures == 0 and "failed to boot" not in caplog.text
    assert len(h.workers()) == 2


def test_handler_exits_never_halt_the_supervisor(h: Harness) -> None:
    h.started()
    for step in range(3 * MAX_BOOT_FAILURES):
        pid = h.workers()[0]
        h.boot(pid)
        h.lease(pid, step_id=step)
        h.exit(pid, ExitStatus(code=ExitCode.BOOT_ERROR))  # os._exit(3) in the handler
    assert not h.arbiter.halted and h.arbiter.boot_failures == 0


def test_a_boot_error_the_worker_announced_mid_step_is_its_own(h: Harness) -> None:
    pid = booted_worker(h)
    h.lease(pid)
    assert exit_by(h.arbiter.children[pid], ExitStatus(code=3)) is ExitBy.HANDLER
    h.send(pid, channel.Exit(code=ExitCode.BOOT_ERROR))
    assert exit_by(h.arbiter.children[pid], ExitStatus(code=3)) is ExitBy.CHILD


def test_an_idle_workers_unannounced_exit_is_taken_as_its_own(h: Harness) -> None:
    # Nothing but the worker ran in it: a lost `exit` line changes nothing.
    pid = booted_worker(h)
    assert exit_by(h.arbiter.children[pid], ExitStatus(code=4)) is ExitBy.CHILD
    h.exit(pid, ExitStatus(code=ExitCode.LEASE_LOST))
    assert h.arbiter.boot_failures == 0


def test_a_boot_failure_still_backs_off(h: Harness) -> None:
    pid = booted_worker(h)
    h.leave(pid, ExitCode.BOOT_ERROR)
    assert len(h.workers()) == 1
    h.clock.advance(BOOT_BACKOFF)
    h.arbiter.tick()
    assert len(h.workers()) == 2


def test_the_restart_metric_names_a_handlers_exit() -> None:
    h = Harness()
    metrics = Metrics()
    h.arbiter.events = metrics
    pid = booted_worker(h)
    h.lease(pid)
    h.exit(pid, ExitStatus(code=3))
    other = h.workers()[1]
    h.leave(other, ExitCode.BOOT_ERROR)
    text = generate_latest(metrics.registry)
    assert b'cyclone_worker_restarts_total{reason="handler_exit"} 1.0' in text
    assert b'cyclone_worker_restarts_total{reason="boot_error"} 1.0' in text


def test_a_lease_lost_exit_while_renewals_fail_releases_the_step_as_our_kill_would(
    h: Harness,
) -> None:
    """The worker's keeper and the supervisor's kill for the lost session race to stop a step
    whose lease is not being renewed: either way, the attempt is not spent."""
    pid = booted_worker(h)
    h.lease(pid)
    h.arbiter.renewal_failed(OSError("the database is down"))
    h.leave(pid, ExitCode.LEASE_LOST)
    assert h.store.released == [(7, tok(7))] and h.store.failed == []


def test_a_lease_lost_exit_with_renewals_working_is_still_recorded_as_a_crash(h: Harness) -> None:
    pid = booted_worker(h)
    h.lease(pid)
    h.leave(pid, ExitCode.LEASE_LOST)
    assert h.store.released == [] and [f[2] for f in h.store.failed] == [ErrorKind.CRASHED]

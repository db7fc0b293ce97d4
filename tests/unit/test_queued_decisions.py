"""The arbiter's part in leases queued in a worker's name (supervisor/dispatch.py): it watches
a queued lease from the moment its worker starts it (`took`), gives back those a worker never
started when it is gone, tells the dispatcher of a revoked one, and kills only the running
step."""

from __future__ import annotations

import signal
from typing import Any

from fakes import Harness, tok

from cyclone.child import channel
from cyclone.states import ErrorKind
from cyclone.supervisor.children import ExitStatus, KillReason
from cyclone.supervisor.dispatch import Ready

KILLED = ExitStatus(signal=signal.SIGKILL)


def queue(h: Harness, pid: int, step_id: int, kill_after: float | None = 2.0) -> Ready:
    """A lease taken ahead in this worker's name now, and queued for it."""
    row = {
        "id": step_id, "lease_token": tok(step_id), "run_id": "r1", "workflow": "wf",
        "node": "n", "attempt": 1, "kill_after": kill_after, "deadline_left": None,
        "item_index": None,
    }  # fmt: skip
    ready = Ready(row, h.clock.now, "worker", told=True)
    h.arbiter.children[pid].queued.append(ready)
    return ready


def took(h: Harness, pid: int, step_id: int, finished: int | None = None) -> None:
    """The worker starts a queued lease now, having finished step `finished`."""
    done = None
    if finished is not None:
        done = {"step_id": finished, "token": tok(finished), "run_id": tok(99), "output": None,
                "next": None, "last": True}  # fmt: skip
    h.send(pid, channel.Took(step_id=step_id, token=tok(step_id), at=h.clock.now,
                             duration=0.001, finished=done))  # fmt: skip


def test_a_queued_steps_timeout_counts_from_when_its_worker_started_it(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, step_id=7, kill_after=2.0)
    queue(h, pid, 8, kill_after=2.0)
    h.clock.advance(0.2)  # queued while step 7 ran
    took(h, pid, 8, finished=7)
    lease = h.arbiter.children[pid].lease
    assert lease.step_id == 8 and h.arbiter.children[pid].queued == []
    assert lease.timeout_at == h.clock.now + 2.0
    assert lease.renewed_at == h.clock.now - 0.2  # its term runs from when it was taken
    h.clock.advance(1.9)
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == []  # 2.1 s after it was queued: not past its timeout
    h.clock.advance(0.2)
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == [("pid", signal.SIGTERM)]
    h.exit(pid, KILLED)
    assert h.store.failed == [(8, tok(8), ErrorKind.TIMEOUT, "attempt 1 ran past its timeout")]


def test_a_took_line_for_a_lease_no_longer_queued_starts_nothing(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, step_id=7)
    took(h, pid, 8, finished=7)  # given back as too old: the worker does not run it either
    assert h.arbiter.children[pid].lease is None


def test_the_leases_queued_for_a_worker_that_died_go_back_after_its_last_lines(
    h: Harness,
) -> None:
    given: list[Any] = []
    h.arbiter.give_back = given.extend
    pid = h.started()[0]
    h.lease(pid, step_id=7)
    queued = [queue(h, pid, n) for n in (8, 9, 10)]
    handle = h.arbiter.children[pid]
    # Its `took` for 8 is still in its channel as it dies: 8 ran, and crashed.
    h.ops.pipes[handle.fd].append(channel.encode(channel.Took(
        step_id=8, token=tok(8), at=h.clock.now, duration=0.001,
        finished={"step_id": 7, "token": tok(7), "run_id": tok(99), "output": None,
                  "next": None, "last": True},
    )))  # fmt: skip
    h.exit(pid, KILLED)
    assert given == queued[1:]
    assert [(f[0], f[2]) for f in h.store.failed] == [(8, ErrorKind.CRASHED)]


def test_a_revoked_queued_lease_goes_to_the_dispatcher(h: Harness) -> None:
    told: list[tuple[Any, Ready]] = []
    h.arbiter.revoke_queued = lambda handle, ready: told.append((handle, ready))
    pid = h.started()[0]
    h.lease(pid, step_id=7)
    ready = queue(h, pid, 8)
    h.store.revocations = {8: "cancelled"}
    h.arbiter.on_notify()
    h.arbiter.tick()
    assert told == [(h.arbiter.children[pid], ready)]
    assert h.ops.signals_to(pid) == []  # the running step is not the one revoked


def test_a_step_started_from_the_queue_after_a_kill_for_the_one_before_is_watched(
    h: Harness,
) -> None:
    """As a step leased after the one its worker was killed for (test_supervisor_decisions):
    the arbiter knows the worker holds it, and fails it as crashed once the worker is dead."""
    pid = h.started()[0]
    h.lease(pid, step_id=7, kill_after=1.0)
    queue(h, pid, 8)
    h.clock.advance(1.01)
    h.arbiter.tick()  # step 7 ran past its timeout: SIGTERM
    took(h, pid, 8, finished=7)  # it had finished a moment before, and started 8
    assert h.arbiter.children[pid].lease.step_id == 8
    h.exit(pid, ExitStatus(code=channel.ExitCode.STOPPED))
    assert [(f[0], f[2]) for f in h.store.failed] == [(8, ErrorKind.CRASHED)]
    assert h.arbiter.kills == {KillReason.TIMEOUT: 1}

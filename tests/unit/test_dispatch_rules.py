"""The two rules that bound the supervisor's leases taken ahead (supervisor/dispatch.py), on
their own: a lease held ready is handed on only while young, for READY_FOR at most and for no
more than READY_SHARE of its step's time to kill; a finished task whose recording statement
failed goes with the next statement TAKEN_TRIES times at most (then its lease expires)."""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import psycopg
import pytest

from cyclone.child import channel
from cyclone.supervisor import dispatch
from cyclone.supervisor.dispatch import (
    READY_FOR,
    READY_SHARE,
    TAKEN_TRIES,
    Dispatcher,
    Ready,
    Taken,
)

SENT = 1000.0


def ready(kill_after: float | None, generation: int = 0) -> Ready:
    return Ready(row={"kill_after": kill_after}, sent=SENT, name="host:1", generation=generation)


def test_the_rules_constants_are_the_documented_ones() -> None:
    # operators.md and the bench figures assume these: a change is a decision, not a slip.
    assert (READY_FOR, READY_SHARE, TAKEN_TRIES) == (0.25, 0.05, 3)


@pytest.mark.parametrize(
    ("kill_after", "age", "fresh"),
    [
        (None, 0.0, True),
        (None, READY_FOR, True),
        (None, READY_FOR + 0.001, False),  # unbounded step: READY_FOR alone
        (10.0, READY_FOR, True),  # 5% of 10 s is 0.5 s: READY_FOR binds first
        (10.0, READY_FOR + 0.001, False),
        (1.0, 0.05, True),  # 5% of a 1 s step: 50 ms
        (1.0, 0.051, False),
        (1.0, 0.2, False),  # young by READY_FOR, too old for its step's time
        (0.2, 0.0101, False),  # 5% of 200 ms: 10 ms
        (0.2, 0.01, True),
    ],
)  # fmt: skip
def test_a_lease_held_ready_is_fresh_for_5_percent_of_its_steps_time_at_most(
    kill_after: float | None, age: float, fresh: bool
) -> None:
    assert ready(kill_after).fresh(SENT + age, 0) is fresh


def test_a_lease_held_ready_under_another_config_is_never_fresh() -> None:
    assert not ready(None, generation=0).fresh(SENT, 1)


class Arbiter:
    children: dict = {}
    draining = False
    generation = 0


def test_a_finished_task_is_retried_by_taken_tries_statements_then_dropped(caplog) -> None:
    d = Dispatcher("dbname=unused", workflows=lambda: (), lease_ttl=30.0)
    taken = Taken(held=None, finished={"step_id": 7}, duration=0.01)
    d.taken = [taken]
    sent = 0
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        while d.taken:
            assert sent < 10 * TAKEN_TRIES, "retried without end"
            # The next statement takes it along, and fails (a deadlock, say).
            session = SimpleNamespace(batch=[], releasing=[], arming=False, taken=d.taken, ahead=[])
            d.taken = []
            sent += 1
            d.failed(session, psycopg.errors.DeadlockDetected("deadlock"), Arbiter())
    assert sent == TAKEN_TRIES
    assert "1 finished steps could not be recorded" in caplog.text


def test_a_statement_that_failed_keeps_every_finished_task_with_tries_left() -> None:
    d = Dispatcher("dbname=unused", workflows=lambda: (), lease_ttl=30.0)
    fresh = Taken(held=None, finished={"step_id": 1}, duration=0.0)
    last = Taken(held=None, finished={"step_id": 2}, duration=0.0, tries=TAKEN_TRIES - 1)
    later = Taken(held=None, finished={"step_id": 3}, duration=0.0)
    d.taken = [later]  # finished while the statement was in flight
    session = SimpleNamespace(batch=[], releasing=[], arming=False, taken=[fresh, last], ahead=[])
    d.failed(session, psycopg.errors.DeadlockDetected("deadlock"), Arbiter())
    assert d.taken == [fresh, later] and fresh.tries == 1


def test_a_parked_worker_whose_look_failed_stays_parked_and_the_others_record_on_their_own():
    """A statement that failed, its session still up (its answer unreadable, say), tells the
    workers whose tasks it carried to record them on their own (`given {"recorded":null}`). A
    parked worker, which carried none, is kept parked: told the same, it took it for "no step"
    and slept its poll interval, deaf to the wake-ups meanwhile. With no notification on the
    way, it is armed for one."""
    d = Dispatcher("dbname=unused", workflows=lambda: (), lease_ttl=30.0, listening=lambda: True)
    pairs = [socket.socketpair() for _ in range(2)]
    for ours, _ in pairs:
        ours.setblocking(False)
    parked = SimpleNamespace(pid=1, fd=pairs[0][0].fileno(), queued=[])
    busy = SimpleNamespace(pid=2, fd=pairs[1][0].fileno(), queued=[])
    arbiter = SimpleNamespace(children={1: parked, 2: busy}, draining=False, generation=0)
    look = channel.Want(lease=True, park=True)
    done = channel.Want(lease=True, finished={"step_id": 7, "token": "t"})
    session = SimpleNamespace(
        batch=[(parked, look), (busy, done)], releasing=[], arming=False, taken=[], ahead=[]
    )
    d.failed(session, psycopg.DatabaseError("the dispatch statement returned nothing"), arbiter)
    assert d.parked == [(parked, look)] and d.arm
    assert pairs[1][1].recv(100) == b'given {"recorded":null}\n'
    pairs[0][1].setblocking(False)
    with pytest.raises(BlockingIOError):
        pairs[0][1].recv(100)  # nothing for the parked one
    for ours, theirs in pairs:
        ours.close()
        theirs.close()

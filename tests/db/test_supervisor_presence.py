"""Presence: what a supervisor publishes about itself and its workers, and who removes it."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

from cyclone.child.session import connect_briefly
from cyclone.engine.sweeps import sweep_stale_supervisors
from cyclone.states import PUBLISH_INTERVAL, STALE_AFTER
from cyclone.supervisor.children import HeldLease, Role, WorkerHandle
from cyclone.supervisor.presence import (
    KILL_MARGIN,
    MAX_SILENCE,
    PUBLISH_MARGIN,
    Presence,
    snapshot,
)
from cyclone.testing import TestEnv

RUN = str(uuid.uuid4())


def handle(pid: int, number: int, *, lease: bool = False, generation: int = 0) -> WorkerHandle:
    held = HeldLease(
        step_id=pid, token="t", run_id=RUN, workflow="orders", node="reserve", attempt=2,
        leased_at=90.0, timeout_at=None, deadline_at=None,
    )  # fmt: skip
    return WorkerHandle(
        pid=pid, role=Role.WORKER, number=number, generation=generation, fd=-1,
        spawned_at=0.0, last_seen=0.0, lease=held if lease else None,
    )  # fmt: skip


def rows(env: TestEnv, table: str) -> list[dict]:
    order = "slot" if table == "cyclone_workers" else "id"
    return env.conn.execute(f"SELECT * FROM {table} ORDER BY {order}").fetchall()


def test_a_publish_upserts_the_supervisor_and_one_row_per_worker_slot(env: TestEnv) -> None:
    presence = Presence(lambda: connect_briefly(env.dsn), host="vm1", pid=4242)
    scanner = WorkerHandle(pid=9, role=Role.SCANNER, number=0, generation=0, fd=-1,
                           spawned_at=0.0, last_seen=0.0)  # fmt: skip
    children = [handle(11, 1, lease=True), handle(12, 2), scanner]
    assert presence.publish(snapshot(children, draining=False, target=2, uptime=5, now=100), 0)
    (sup,) = rows(env, "cyclone_supervisors")
    assert (sup["host"], sup["pid"], sup["state"], sup["workers_target"]) == (
        "vm1", 4242, "running", 2,
    )  # fmt: skip
    busy, idle = rows(env, "cyclone_workers")
    assert (busy["slot"], busy["pid"], busy["state"], busy["workflow"], busy["node"]) == (
        1, 11, "busy", "orders", "reserve",
    )  # fmt: skip
    assert (str(busy["run_id"]), busy["attempt"], busy["step_id"]) == (RUN, 2, 11)
    # Busy for 10 s on the supervisor's clock: busy_since is 10 s before the database's now.
    assert abs((busy["seen_at"] - busy["busy_since"]) - timedelta(seconds=10)) < timedelta(
        seconds=1
    )
    assert (idle["state"], idle["step_id"], idle["busy_since"]) == ("idle", None, None)

    # The next publish: worker 2 is gone, worker 1 is idle, and we are draining.
    presence.publish(snapshot([handle(11, 1)], draining=True, target=2, uptime=7, now=102), 2)
    assert rows(env, "cyclone_supervisors")[0]["state"] == "draining"
    assert [(w["slot"], w["state"]) for w in rows(env, "cyclone_workers")] == [(1, "idle")]

    presence.withdraw()
    assert rows(env, "cyclone_supervisors") == [] and rows(env, "cyclone_workers") == []


def test_publishes_share_one_connection_and_one_lost_is_replaced(env: TestEnv) -> None:
    opened: list[int] = []

    def connect():
        conn = connect_briefly(env.dsn)
        opened.append(conn.info.backend_pid)
        return conn

    presence = Presence(connect, host="vm1", pid=4242)
    snap = snapshot([handle(11, 1)], draining=False, target=1, uptime=1, now=100)
    assert presence.publish(snap, 0) and presence.publish(snap, 1)
    assert len(opened) == 1
    # The server ends the session (a restart, a pooler, an idle timeout): the publish that
    # finds out fails, the next one opens a new connection.
    env.conn.execute("SELECT pg_terminate_backend(%s)", (opened[0],))
    assert not presence.publish(snap, 2)
    assert presence.publish(snap, 3)
    assert len(opened) == 2 and opened[1] != opened[0]
    presence.withdraw()
    assert presence.session.conn is None and rows(env, "cyclone_supervisors") == []


def test_a_slot_shared_during_a_reload_shows_the_busy_worker() -> None:
    old = handle(11, 1, lease=True, generation=0)
    new = handle(21, 1, generation=1)
    snap = snapshot([new, old], draining=False, target=1, uptime=1, now=100)
    assert [(w["slot"], w["pid"]) for w in snap.workers] == [(1, 11)]
    snap = snapshot([handle(11, 1, generation=0), new], draining=False, target=1, uptime=1, now=1)
    assert [(w["slot"], w["pid"]) for w in snap.workers] == [(1, 21)]


def test_publishing_waits_for_changes_the_interval_and_any_kill_that_may_fall_due() -> None:
    presence = Presence(lambda: None, host="h", pid=1)  # type: ignore[arg-type,return-value]
    assert presence.due(0.0, None)
    presence.last_try, presence.last_published, presence.changed = 10.0, 10.0, False
    assert not presence.due(10.0 + PUBLISH_INTERVAL / 2, None)
    assert presence.due(10.0 + PUBLISH_INTERVAL, None)
    presence.mark_changed()
    assert presence.due(10.6, None)
    # A kill due in one second: the publish (which may block on a connect) waits.
    assert not presence.due(10.6, next_kill_at=11.6)


def test_a_kill_always_close_by_delays_a_publish_by_at_most_max_silence(env: TestEnv) -> None:
    presence = Presence(lambda: connect_briefly(env.dsn), host="h", pid=1)
    snap = snapshot([handle(11, 1)], draining=False, target=1, uptime=0, now=0)
    assert presence.publish(snap, 10.0)
    # On the kept connection a publish is one statement: only a kill closer than that waits.
    assert presence.due(12.0, next_kill_at=12.0 + PUBLISH_MARGIN + 0.1)
    assert not presence.due(12.0, next_kill_at=12.0 + PUBLISH_MARGIN - 0.1)
    # Steps with short timeouts back to back: some kill is always close. Liveness still goes
    # out once MAX_SILENCE has passed.
    assert not presence.due(10.0 + MAX_SILENCE - 0.1, next_kill_at=10.0 + MAX_SILENCE)
    assert presence.due(10.0 + MAX_SILENCE, next_kill_at=10.0 + MAX_SILENCE + 0.01)
    presence.session.close()  # without the connection, a publish may also have to connect
    assert not presence.due(12.0, next_kill_at=12.0 + PUBLISH_MARGIN + 0.1)
    assert presence.due(12.0, next_kill_at=12.0 + KILL_MARGIN + 0.1)
    presence.withdraw()


def test_the_scanner_never_removes_a_live_supervisor_however_long_unseen(env: TestEnv) -> None:
    live = Presence(lambda: connect_briefly(env.dsn), host="live", pid=1)
    dead = Presence(lambda: connect_briefly(env.dsn), host="dead", pid=2)
    try:
        for presence in (live, dead):
            snap = snapshot([handle(11, 1)], draining=False, target=1, uptime=0, now=0)
            presence.publish(snap, 0)
        dead.close()  # its connection (and lock) went with its process
        later = env.conn.execute("SELECT now() + interval '1 hour' AS t").fetchone()["t"]
        assert sweep_when_gone(env, now=later, held=1) == 1
        assert [s["host"] for s in rows(env, "cyclone_supervisors")] == ["live"]
        live.close()  # its lock is gone: now it is dead too
        assert sweep_when_gone(env, now=later) == 1
    finally:
        live.close()
        dead.close()


def test_a_failed_publish_is_retried_later_and_never_raises(env: TestEnv) -> None:
    presence = Presence(
        lambda: connect_briefly("postgresql://nobody@127.0.0.1:1/x?connect_timeout=2"),
        host="h", pid=1,
    )  # fmt: skip
    assert not presence.publish(snapshot([], draining=False, target=1, uptime=0, now=0), 50.0)
    assert not presence.due(51.0, None) and presence.due(56.0, None)
    presence.withdraw()  # never published: nothing to do


def sweep_when_gone(env: TestEnv, now: object = None, held: int = 0) -> int:
    """One sweep, once closed presence connections are gone on the server too (a backend
    releases its session lock as it exits, a moment after its client closed it)."""
    claimed = (
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
        " AND classid = hashtext(current_schema() || '.cyclone_supervisors')::oid"
    )
    deadline = time.monotonic() + 10
    while env.conn.execute(claimed).fetchone()["n"] > held and time.monotonic() < deadline:
        time.sleep(0.01)
    return sweep_stale_supervisors(env.conn, batch_size=10, now=now)  # type: ignore[arg-type]


def test_the_scanner_removes_supervisors_not_seen_for_ten_intervals(env: TestEnv) -> None:
    for name in ("alive", "dead"):
        presence = Presence(lambda: connect_briefly(env.dsn), host=name, pid=1)
        presence.publish(snapshot([handle(11, 1)], draining=False, target=1, uptime=0, now=0), 0)
        presence.close()  # as a supervisor that died: its rows stay
    env.conn.execute(
        "UPDATE cyclone_supervisors SET seen_at = now() - make_interval(secs => %s)"
        " WHERE host = 'dead'", [STALE_AFTER + 1],
    )  # fmt: skip
    assert sweep_when_gone(env) == 1
    assert [s["host"] for s in rows(env, "cyclone_supervisors")] == ["alive"]
    assert len(rows(env, "cyclone_workers")) == 1  # the dead one's workers went by cascade
    # With a fixed `now` far enough ahead, the live one is stale too.
    later = env.conn.execute("SELECT now() + interval '1 hour' AS t").fetchone()["t"]
    assert sweep_when_gone(env, now=later) == 1
    assert rows(env, "cyclone_supervisors") == []


def test_another_attempt_of_the_same_step_is_busy_from_its_own_lease(env: TestEnv) -> None:
    """Issue 27, item 14: `elapsed` after a hand-over (the step leased again, a retry or
    another worker in the slot) counts from that lease, not from the first attempt's."""
    presence = Presence(lambda: connect_briefly(env.dsn), host="vm1", pid=4242)
    first = handle(11, 1, lease=True)
    presence.publish(snapshot([first], draining=False, target=1, uptime=5, now=100), 0)
    since = rows(env, "cyclone_workers")[0]["busy_since"]
    # The same attempt, published again later: busy_since does not drift.
    presence.publish(snapshot([first], draining=False, target=1, uptime=9, now=104), 4)
    assert rows(env, "cyclone_workers")[0]["busy_since"] == since
    # Attempt 3 of the same step, leased at 103 by a new worker in the slot: 1 s busy.
    again = handle(12, 1, lease=True)
    assert again.lease is not None
    again.lease.step_id, again.lease.attempt, again.lease.leased_at = 11, 3, 103.0
    presence.publish(snapshot([again], draining=False, target=1, uptime=10, now=104), 8)
    (row,) = rows(env, "cyclone_workers")
    assert (row["pid"], row["attempt"]) == (12, 3)
    assert abs((row["seen_at"] - row["busy_since"]) - timedelta(seconds=1)) < timedelta(
        seconds=0.5
    )
    presence.withdraw()


def test_a_lease_names_its_worker_apart_from_its_supervisor() -> None:
    """Issue 27, item 14: leased_by read `vm:13621`, which `cyclone workers` would take for a
    supervisor's host:pid; it names the supervisor, then which of its workers."""
    from cyclone.child.proctitle import worker_name

    assert worker_name("vm", 13610, 2, 13621) == "vm:13610 worker 2 pid 13621"

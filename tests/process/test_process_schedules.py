"""Schedules ticked by real scanners: two supervisors (two scanners) on a schedule of one tick a
second, one killed and started again and PostgreSQL restarted in the middle; every tick has
exactly one run, the ticks of the gaps caught up (docs/schedules.md)."""

from __future__ import annotations

import signal
import time
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from proc_flows import parked
from proc_helpers import restart, wait_for

from cyclone.clients.client import Client
from cyclone.testing import TestEnv

pytestmark = pytest.mark.process

PREFIX = "cyclone-schedule:every-second:"


def ticks(dsn: str) -> list[datetime]:
    """The tick of each run of the schedule (its key names it), on a fresh connection: the
    test's own sessions die with the restart."""
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            rows = conn.execute(
                "SELECT idempotency_key FROM cyclone_runs WHERE idempotency_key LIKE %s",
                (PREFIX + "%",),
            ).fetchall()
    except psycopg.OperationalError:
        return []
    return sorted(datetime.fromisoformat(r[0].removeprefix(PREFIX)) for r in rows)


def grows(dsn: str, more_than: int) -> Any:
    return lambda: len(ticks(dsn)) > more_than


def test_every_tick_has_one_run_across_two_scanners_a_kill_and_a_postgres_restart(
    supervisor, private_server
) -> None:
    fast = {"scanner__interval": '"0.2s"'}
    with TestEnv(dsn=private_server.get_uri()) as env:
        env.register(parked)  # runs that wait for a signal: no worker needed, all stay active
        env.client.schedule("every-second", parked, every=1, overlap="allow_all")
        first = supervisor(workers=1, dsn=env.dsn, **fast)
        second = supervisor(workers=1, dsn=env.dsn, **fast)
        wait_for(grows(env.dsn, 3), 20, f"ticks from two scanners\n{first.log()}")
        first.stop()  # SIGKILL, children too: its scanner may die mid-tick
        seen = len(ticks(env.dsn))
        wait_for(grows(env.dsn, seen + 2), 20, f"the other scanner ticking\n{second.log()}")
        restart(private_server)
        seen = len(ticks(env.dsn))
        wait_for(grows(env.dsn, seen + 2), 30, f"ticks after the restart\n{second.log()}")
        second.stop()
        time.sleep(3)  # no scanner at all: these ticks wait for the next one
        third = supervisor(workers=1, dsn=env.dsn, **fast)
        seen = len(ticks(env.dsn))
        wait_for(grows(env.dsn, seen + 4), 20, f"the gap caught up\n{third.log()}")
        with Client(env.dsn) as client:
            client.pause_schedule("every-second")
            got = ticks(env.dsn)
            (info,) = client.schedules()
        third.popen.send_signal(signal.SIGTERM)  # before the schema goes with the TestEnv
        third.popen.wait(10)
        # One run a tick, none left out: consecutive seconds from the first tick to the last.
        assert got == [got[0] + timedelta(seconds=n) for n in range(len(got))], got
        assert (info.started, info.skipped, info.missed) == (len(got), 0, 0)
        env.conn.close()  # broken by the restart; TestEnv.close() reconnects to drop its schema


def test_a_declared_schedule_is_upserted_by_each_supervisor_and_reported_once_removed(
    env: TestEnv, supervisor
) -> None:
    one = supervisor(workers=1, workflows__modules='["proc_schedule_flows"]')
    two = supervisor(workers=1, workflows__modules='["proc_schedule_flows"]')
    (s,) = env.client.schedules()
    assert (s.name, s.workflow, s.declared, s.every) == (
        "declared-every-second", "proc-declared", True, 1.0,
    )  # fmt: skip
    wait_for(lambda: env.client.schedules()[0].started >= 2, 20, f"ticks\n{one.log()}")
    one.stop()
    two.stop()
    # A deploy without the declaration: reported in the log, the schedule kept (and ticking).
    three = supervisor(workers=1, workflows__modules='["proc_schedule_flows_v2"]')
    wait_for(lambda: "no longer declared in code" in three.log(), 10, three.log())
    assert "'declared-every-second'" in three.log()
    assert [s.name for s in env.client.schedules()] == ["declared-every-second"]
    env.client.pause_schedule("declared-every-second")

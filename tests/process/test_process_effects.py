"""Effects written through ctx.transaction() happen exactly once, whatever froze or died.

proc_flows.pay writes one row through the fenced transaction and then works on, ignoring
ctx.done, so freezes and kills land between the write and its commit. At the end every run
completed, and each step has exactly one row: the one its completing attempt wrote.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from typing import Any

import psycopg
import pytest
from proc_helpers import LEASES, TTL, children, completed, restart, wait_for

from cyclone.clients.client import Client
from cyclone.states import RunState
from cyclone.testing import TestEnv

pytestmark = pytest.mark.process


def make_table(env: TestEnv) -> None:
    env.conn.execute("CREATE TABLE proc_effects (step_id bigint, attempt int, pid int)")


def check_exactly_once(env: TestEnv, run_ids: list[str]) -> None:
    with psycopg.connect(env.dsn, row_factory=psycopg.rows.dict_row) as conn:
        steps = conn.execute(
            "SELECT id, attempt, state FROM cyclone_steps WHERE run_id = ANY(%s::uuid[])",
            (run_ids,),
        ).fetchall()
        rows = conn.execute("SELECT step_id, attempt FROM proc_effects").fetchall()
    by_step: dict[int, list[int]] = {}
    for row in rows:
        by_step.setdefault(row["step_id"], []).append(row["attempt"])
    assert len(steps) == len(run_ids)
    for step in steps:
        assert step["state"] == "completed"
        assert by_step.get(step["id"]) == [step["attempt"]], f"step {step['id']}"
    assert len(rows) == len(steps)


def pids_of(sup: Any) -> list[int]:
    return children(sup.pid)


def test_effects_happen_once_across_frozen_workers_and_a_killed_supervisor(
    env, supervisor, tmp_path
) -> None:
    from proc_flows import effects

    make_table(env)
    first = supervisor(workers=3, **LEASES)
    run_ids = env.client.submit_many(effects, [{"seconds": 0.6} for _ in range(24)])
    rng = random.Random(7)
    frozen = 0
    deadline = time.monotonic() + 15
    while frozen < 4 and time.monotonic() < deadline:
        busy = [
            pid for pid in first.workers()
            if env.conn.execute(
                "SELECT 1 FROM cyclone_steps WHERE state = 'running' AND leased_by LIKE %s",
                (f"% pid {pid}",),
            ).fetchone()
        ]  # fmt: skip
        if not busy:
            time.sleep(0.05)
            continue
        pid = busy[0]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(TTL + rng.uniform(0.1, 1.0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        frozen += 1
    # Else the loop ran out of time with nothing frozen, and the test would check nothing.
    assert frozen >= 2, f"froze {frozen} busy workers in 15 s"
    # A frozen worker is killed before its lease can lapse (silent), its attempt recorded
    # crashed: the freezes reached steps mid-write.
    crashed = env.conn.execute(
        "SELECT count(*) AS n FROM cyclone_step_attempts WHERE error_kind = 'crashed'"
    ).fetchone()["n"]
    assert crashed >= 1, "no frozen worker's attempt was cut short"
    # The supervisor dies mid-step (its workers die with it); another host takes over once
    # their leases lapse.
    first.popen.send_signal(signal.SIGKILL)
    first.popen.wait(5)
    supervisor(workers=3, **LEASES)
    wait_for(lambda: all(completed(env, r) for r in run_ids), 60, "every run to complete")
    check_exactly_once(env, run_ids)


def test_effects_happen_once_when_a_whole_host_freezes_and_another_takes_over(
    env, supervisor, tmp_path
) -> None:
    """SIGSTOP a supervisor and every process it forked, as a frozen VM: nothing local can
    stop its workers from going on when they thaw, after the other host reran their steps."""
    from proc_flows import effects

    make_table(env)
    frozen_host = supervisor(workers=2, **LEASES)
    run_ids = env.client.submit_many(effects, [{"seconds": 1.0} for _ in range(4)])
    wait_for(
        lambda: env.conn.execute("SELECT count(*) AS n FROM proc_effects").fetchone()["n"] >= 2
        or None, 10, "both workers to write",
    )  # fmt: skip
    host = [frozen_host.pid, *pids_of(frozen_host)]
    for pid in host:
        os.kill(pid, signal.SIGSTOP)
    try:
        other = supervisor(workers=2, **LEASES)
        wait_for(lambda: all(completed(env, r) for r in run_ids), 30, "the other host to finish")
        for pid in reversed(host):  # the workers thaw first: their supervisor cannot kill yet
            os.kill(pid, signal.SIGCONT)
    finally:
        for pid in host:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    # Drained, the thawed host has nothing left that could still commit.
    frozen_host.popen.send_signal(signal.SIGTERM)
    assert frozen_host.popen.wait(15) == 0
    check_exactly_once(env, run_ids)
    assert other.popen.poll() is None


def test_effects_happen_once_across_a_postgres_restart(
    supervisor,
    private_server,
) -> None:
    from proc_flows import effects

    with TestEnv(dsn=private_server.get_uri()) as env:
        make_table(env)
        sup = supervisor(workers=2, dsn=env.dsn, **LEASES)
        run_ids = env.client.submit_many(effects, [{"seconds": 0.2} for _ in range(30)])
        wait_for(
            lambda: env.conn.execute("SELECT count(*) AS n FROM proc_effects").fetchone()["n"]
            >= 4, 20, "some effects",
        )  # fmt: skip
        restart(private_server)
        with Client(env.dsn) as client:  # the test's own sessions died with the restart
            wait_for(
                lambda: all(client.get_run(r).state == RunState.COMPLETED for r in run_ids),
                60, f"every run to complete\n{sup.log()}",
            )  # fmt: skip
        check_exactly_once(env, run_ids)
        sup.popen.send_signal(signal.SIGTERM)  # before the schema goes with the TestEnv
        assert sup.popen.wait(10) == 0
        env.conn.close()  # broken by the restart; TestEnv.close() reconnects to drop its schema

"""Outages: PostgreSQL restarting under load, and a worker frozen past its lease."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from typing import Any

import psycopg
import pytest
from proc_helpers import completed, restart, wait_for

from cyclone.clients.client import Client
from cyclone.states import StepState
from cyclone.testing import TestEnv

pytestmark = pytest.mark.process


def query(dsn: str, sql: str, *params: Any) -> list[dict[str, Any]]:
    """On a fresh connection: the test's own sessions die with the restart too."""
    with psycopg.connect(dsn, row_factory=psycopg.rows.dict_row, connect_timeout=2) as conn:
        return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]


def runs_done(dsn: str) -> dict[str, int]:
    try:
        rows = query(dsn, "SELECT state, count(*) AS n FROM cyclone_runs GROUP BY state")
    except psycopg.OperationalError:
        return {}
    return {r["state"]: r["n"] for r in rows}


def test_a_postgres_restart_under_load_loses_nothing_and_completes_every_run_once(
    supervisor, private_server, tmp_path
) -> None:
    from proc_flows import busy

    with TestEnv(dsn=private_server.get_uri()) as env:
        sup = supervisor(workers=2, dsn=env.dsn)
        inputs = [{"dir": str(tmp_path), "n": n, "sleep": 0.05} for n in range(40)]
        before = env.client.submit_many(busy, inputs)
        wait_for(lambda: runs_done(env.dsn).get("completed", 0) >= 5, 20, "some progress")
        restart(private_server)
        # New work after the restart is picked up: the workers reconnected.
        with Client(env.dsn) as client:
            more = [{"dir": str(tmp_path), "n": n, "sleep": 0.01} for n in range(40, 60)]
            after = client.submit_many(busy, more)
        wait_for(lambda: runs_done(env.dsn) == {"completed": 60}, 60, f"every run\n{sup.log()}")
        assert sup.popen.poll() is None and "halting" not in sup.log()
        runs = query(env.dsn, "SELECT id::text, output FROM cyclone_runs")
        outputs = {r["id"]: r["output"] for r in runs}
        for n, run_id in enumerate(before + after):
            assert outputs[run_id] == {"after": n + 1}
        steps = query(env.dsn, "SELECT run_id, node, state FROM cyclone_steps")
        assert len(steps) == 120 and all(s["state"] == StepState.COMPLETED for s in steps)
        wait_for(lambda: len(sup.workers()) == 2, 10, "two workers again")
        sup.popen.send_signal(signal.SIGTERM)  # before the schema goes with the TestEnv
        assert sup.popen.wait(10) == 0
        env.conn.close()  # broken by the restart; TestEnv.close() reconnects to drop its schema


def test_a_worker_frozen_past_its_lease_changes_nothing_when_it_wakes(
    env, supervisor, tmp_path
) -> None:
    """SIGSTOP the worker *and* its supervisor: otherwise the supervisor kills a worker the OS
    says is stopped (test_process_lifecycle checks that), and no late write is ever tried.
    Stopped together they are what a frozen VM or a long GC pause would leave: a scanner
    reclaims the lease and another host's worker runs the step again. Then the frozen worker
    wakes first."""
    from proc_flows import busy

    sup = supervisor(workers=1)
    run_id = env.client.submit(busy, {"dir": str(tmp_path), "n": 1, "sleep": 1.0})
    spans = tmp_path / "spans.log"
    wait_for(lambda: spans.exists() and spans.read_text(), 10, "the step to start")
    frozen = int(spans.read_text().split()[3])
    os.kill(sup.pid, signal.SIGSTOP)
    os.kill(frozen, signal.SIGSTOP)
    try:
        # Another host's supervisor: the frozen one leases for no worker of its own.
        supervisor(workers=1)
        status = wait_for(
            lambda: env.client.get_run(run_id) if completed(env, run_id) else None, 20,
            "the run to complete on the other worker",
        )  # fmt: skip
        work = min(env.client.steps(run_id), key=lambda s: s.id)
        assert (work.state, work.attempt) == (StepState.COMPLETED, 2)
        before = snapshot(env, run_id)
        os.kill(frozen, signal.SIGCONT)
        # Its clock tells it the lease may have lapsed: it exits before its handler runs on
        # (its SIGCONT handler or its lease keeper, whichever runs first; or, were its clock
        # wrong, its fenced record finds the lease gone).
        wait_for(
            lambda: re.search(r"lease lost|resumed past its lease|not renewed in time", sup.log()),
            10, "the woken worker to find its lease gone",
        )  # fmt: skip
        assert snapshot(env, run_id) == before
        assert env.client.get_run(run_id).output == status.output == {"after": 2}
    finally:
        for pid in (frozen, sup.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    # Awake again, the supervisor keeps its worker: the woken one, if it found the lease gone
    # when recording (it drops the result and goes on), or a replacement, if its keeper found
    # no renewal in time (it leaves with LEASE_LOST).
    wait_for(lambda: len(sup.workers()) == 1, 10, "its worker")
    assert sup.popen.poll() is None


def snapshot(env: TestEnv, run_id: str) -> list[dict[str, Any]]:
    return env.conn.execute(
        "SELECT id, state, attempt, output, error, error_kind, completed_at, lease_token"
        " FROM cyclone_steps WHERE run_id = %s ORDER BY id", [run_id],
    ).fetchall()  # fmt: skip

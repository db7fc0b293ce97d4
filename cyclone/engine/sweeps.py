"""The scanner's sweeps as plain functions: `sweep_x(conn, batch_size=..., now=None) -> count`.

Each handles one batch in one transaction and is safe to run from any number of scanners at
once (the statements lock runs with SKIP LOCKED and re-check state before writing). The
scanner process calls them in a loop; the test harness calls them directly with its clock.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from cyclone.db import retrying
from cyclone.engine.advance import RunRef, node_completed
from cyclone.engine.graphs import graph_by_hash
from cyclone.engine.runs import cancel_runs, fail_run, lock_run, notify_revoked, settle_late
from cyclone.sql import QUERIES
from cyclone.states import DEADLINE_ERROR, ErrorKind

Conn = psycopg.Connection[Any]
DEFAULT_BATCH = 500


def sweep_deadlines(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Fail running runs past their deadline; returns how many failed."""

    def tx() -> int:
        with conn.transaction():
            row = conn.execute(
                QUERIES["run_fail_deadline_passed"], {"batch_size": batch_size, "now": now}
            ).fetchone()
            if not row["run_ids"]:
                return 0
            settle_late(conn, [str(r) for r in row["run_ids"]], "dead", ErrorKind.DEADLINE,
                        DEADLINE_ERROR, now)  # fmt: skip
            # Child runs of dead-lettered child nodes are cancelled in this same transaction.
            if row["child_run_ids"]:
                cancel_runs(conn, row["child_run_ids"], now, notify=False)
            notify_revoked(conn)
            return len(row["run_ids"])

    return retrying(tx)


def sweep_expired_leases(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Reclaim leases nobody renewed; returns how many steps were reclaimed."""

    def tx() -> int:
        with conn.transaction():
            rows = conn.execute(
                QUERIES["lease_reclaim_expired"], {"batch_size": batch_size, "now": now}
            ).fetchall()
            for run_id in {str(r["run_id"]) for r in rows if r["state"] == "dead"}:
                fail_run(conn, run_id, now)
            if rows:
                notify_revoked(conn)
            return len(rows)

    return retrying(tx)


def sweep_max_wait(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Dead-letter waits and child nodes parked past their max_wait, failing their runs;
    returns how many runs failed (two waits of one run expiring together fail it once)."""

    def tx() -> int:
        with conn.transaction():
            rows = conn.execute(
                QUERIES["wait_expire"], {"batch_size": batch_size, "now": now}
            ).fetchall()
            children = [r["child_run_id"] for r in rows if r["child_run_id"] is not None]
            if children:
                cancel_runs(conn, children, now, notify=False)
            failed = {str(r["run_id"]) for r in rows}
            for run_id in failed:
                fail_run(conn, run_id, now)
            return len(failed)

    return retrying(tx)


def sweep_sleeps(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Complete sleeps that are over and advance their runs; returns how many woke."""

    def tx() -> int:
        with conn.transaction():
            rows = conn.execute(
                QUERIES["sleep_wake"], {"batch_size": batch_size, "now": now}
            ).fetchall()
            for row in rows:
                run = lock_run(conn, row["run_id"])
                ref = RunRef(str(run["id"]), run["workflow"], run["graph_hash"])
                node_completed(conn, ref, graph_by_hash(conn, ref.graph_hash), row["node"], now)
            return len(rows)

    return retrying(tx)


def sweep_retention(
    conn: Conn, *, retention: float, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Delete finished top-level runs older than `retention` seconds; returns how many."""
    with conn.transaction():
        row = conn.execute(
            QUERIES["run_delete_finished"],
            {"retention": retention, "batch_size": batch_size, "now": now},
        ).fetchone()
        return int(row["deleted"])


SWEEPS = (sweep_deadlines, sweep_expired_leases, sweep_max_wait, sweep_sleeps)

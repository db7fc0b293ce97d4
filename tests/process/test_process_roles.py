"""Least privilege: a migrating role, a runtime role, a read-only role, with the printed GRANTs.

The schema is migrated by its own role; the supervisor (workers, scanner) and a client run as
the runtime role, the CLI's listings as the read-only one. DDL, deletes of history and writes
from the read-only role are refused by PostgreSQL itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from proc_helpers import wait_for
from psycopg import sql
from psycopg.conninfo import make_conninfo

from cyclone import engine
from cyclone.clients.client import Client

pytestmark = pytest.mark.process


@dataclass
class Deployment:
    schema: str
    migrator: str
    runtime: str
    readonly: str
    base: str

    def dsn(self, role: str) -> str:
        return make_conninfo(self.base, user=role, options=f"-c search_path={self.schema}")


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cyclone.cli", "--dsn", dsn, *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip


@pytest.fixture
def deployment(pg_dsn: str) -> Iterator[Deployment]:
    tag = uuid.uuid4().hex[:8]
    dep = Deployment(
        f"cyclone_roles_{tag}", f"mig_{tag}", f"run_{tag}", f"ro_{tag}", pg_dsn
    )  # fmt: skip
    roles = (dep.migrator, dep.runtime, dep.readonly)
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        for role in roles:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(
            sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                sql.Identifier(dep.schema), sql.Identifier(dep.migrator)
            )
        )
    try:
        yield dep
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(dep.schema)))
            for role in roles:
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def refused(dsn: str, statement: str, params: Any = None) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute(statement, params)  # type: ignore[arg-type]
        except psycopg.errors.InsufficientPrivilege:
            return True
    return False


def test_the_printed_grants_let_each_role_do_its_job_and_nothing_more(
    deployment: Deployment, supervisor
) -> None:
    from proc_flows import busy

    dep = deployment
    done = cli(dep.dsn(dep.migrator), "migrate")
    assert done.returncode == 0, done.stderr
    grants = cli(
        dep.dsn(dep.migrator), "migrate", "--print-grants", "--migrator", dep.migrator,
        "--runtime", dep.runtime, "--readonly", dep.readonly,
    )  # fmt: skip
    assert grants.returncode == 0 and grants.stdout.startswith("-- "), grants.stderr
    with psycopg.connect(dep.dsn(dep.migrator), autocommit=True) as conn:
        conn.execute(grants.stdout.encode())

    # The runtime role runs the whole thing: supervisor, workers, scanner, a client.
    runtime = dep.dsn(dep.runtime)
    # migrate = true, the default: with the schema current it runs no DDL.
    sup = supervisor(workers=2, dsn=runtime, database__migrate="true")
    with Client(runtime) as client:
        run_ids = client.submit_many(busy, [{"dir": "/tmp", "n": n} for n in range(5)])
        wait_for(lambda: all(completed_as(client, r) for r in run_ids), 30, f"runs\n{sup.log()}")
        cancelled = client.submit(busy, {"dir": "/tmp", "n": 9, "sleep": 5})
        client.cancel(cancelled)
        # Schedules: made, ticked by the scanner, triggered, paused and deleted (migration 19).
        client.schedule("roles-tick", busy, every=1, input={"dir": "/tmp", "n": 1},
                        overlap="allow_all")  # fmt: skip
        wait_for(lambda: client.schedules()[0].started >= 2, 20, f"ticks\n{sup.log()}")
        assert client.trigger_schedule("roles-tick") is not None
        client.pause_schedule("roles-tick")
        assert client.delete_schedule("roles-tick")
    assert "permission denied" not in sup.log()
    with psycopg.connect(runtime, autocommit=True, row_factory=psycopg.rows.dict_row) as conn:
        # Through the function only, and never the last day's runs, whatever it asks for.
        assert engine.sweep_retention(conn, retention=0.0) == 0
        conn.execute("UPDATE cyclone_runs SET finished_at = now() WHERE finished_at IS NOT NULL")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # nor moved into the past
            conn.execute("UPDATE cyclone_runs SET finished_at = 'epoch' WHERE finished_at < now()")
    for statement in (
        "CREATE TABLE sneaky (id int)",
        "DROP TABLE cyclone_runs",
        "ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_pkey",
        "DELETE FROM cyclone_runs",
        "DELETE FROM cyclone_steps",
        "TRUNCATE cyclone_runs",
    ):
        assert refused(runtime, statement), statement

    # The read-only role lists and shows; it writes nothing.
    readonly = dep.dsn(dep.readonly)
    for args in (
        ("runs",), ("workers",), ("dlq", "list"), ("status", "--once"), ("schedules", "list"),
    ):  # fmt: skip
        shown = cli(readonly, *args)
        assert shown.returncode == 0, (args, shown.stderr)
    for statement in (
        "INSERT INTO cyclone_graphs (hash, workflow, graph) VALUES ('x', 'x', '{}')",
        "UPDATE cyclone_steps SET attempt = attempt",
        "DELETE FROM cyclone_supervisors",
        "DELETE FROM cyclone_schedules",
        "SELECT cyclone_delete_finished(0, 10, NULL)",
        "CREATE TABLE sneaky (id int)",
    ):
        assert refused(readonly, statement), statement
    assert cli(readonly, "cancel", cancelled).returncode != 0


def completed_as(client: Client, run_id: str) -> bool:
    return client.get_run(run_id).state == "completed"

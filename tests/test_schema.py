"""The schema: migrations, constraints that mirror the Python enums, and index-backed queries."""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import psycopg
import pytest

import cyclone
from cyclone.db import connect
from cyclone.migrate import latest_version, migrate
from cyclone.sql import QUERIES, parse_queries
from cyclone.states import ErrorKind, NodeKind, RunState, StepState
from cyclone.testing import TestEnv


def _check_values(conn, table: str, column: str) -> set[str]:
    rows = conn.execute(
        "SELECT pg_get_constraintdef(c.oid) AS def FROM pg_constraint c "
        "JOIN pg_class t ON t.oid = c.conrelid JOIN pg_namespace n ON n.oid = t.relnamespace "
        "WHERE n.nspname = current_schema() AND t.relname = %s AND c.contype = 'c'",
        (table,),
    ).fetchall()
    # The column's own list is the widest CHECK on it (others test subsets, like terminal states).
    found = [
        set(re.findall(r"'([a-z_]+)'::text", row["def"]))
        for row in rows
        if re.match(rf"CHECK \(+{column} = ANY", row["def"])
    ]
    assert found, f"no CHECK on {table}.{column}"
    return max(found, key=len)


@pytest.mark.parametrize(
    ("table", "column", "enum"),
    [
        ("cyclone_runs", "state", RunState),
        ("cyclone_steps", "state", StepState),
        ("cyclone_steps", "error_kind", ErrorKind),
        ("cyclone_steps", "kind", NodeKind),
    ],
)
def test_python_enums_match_the_sql_checks(env: TestEnv, table, column, enum):
    assert _check_values(env.conn, table, column) == {e.value for e in enum}


def test_migrating_twice_applies_nothing_the_second_time(env: TestEnv):
    assert migrate(env.conn) == []
    versions = [r["version"] for r in env.conn.execute("SELECT version FROM cyclone_migrations")]
    assert versions == list(range(1, latest_version() + 1))


def test_concurrent_migrators_apply_each_migration_once(pg_dsn: str):
    schema = "cyclone_migrate_race"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        admin.execute(f"CREATE SCHEMA {schema}")
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, options=f"-c search_path={schema}")
    results: list[list[int]] = []
    threads = [threading.Thread(target=lambda: results.append(migrate(dsn))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert sorted(len(r) for r in results) == [0, 0, 0, latest_version()]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


def test_a_running_step_must_hold_a_lease_token(env: TestEnv):
    wf = cyclone.Workflow("schema-lease")
    wf.wait("w")
    env.client.submit(wf, {})
    with pytest.raises(psycopg.errors.CheckViolation):
        env.conn.execute("UPDATE cyclone_steps SET state = 'running'")
    with pytest.raises(psycopg.errors.CheckViolation):
        env.conn.execute("UPDATE cyclone_steps SET state = 'completed'")


def test_every_named_query_is_unique_and_nonempty():
    assert QUERIES and all(body.strip() for body in QUERIES.values())
    with pytest.raises(ValueError, match="twice"):
        parse_queries("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


def _plan(conn, name: str, params: dict) -> str:
    rows = conn.execute(("EXPLAIN " + QUERIES[name]).encode(), params).fetchall()
    return "\n".join(next(iter(r.values())) for r in rows)


def test_hot_queries_use_their_partial_indexes_on_a_large_table(env: TestEnv):
    wf = cyclone.Workflow("schema-plan")

    @wf.task()
    def t(ctx):
        return None

    for _ in range(4):
        env.client.submit_many(wf, [{}] * 5000, run_deadline=timedelta(hours=1))
    # Most rows finished, as in a long-lived queue: the planner must still lease by index.
    env.conn.execute(
        "UPDATE cyclone_steps SET state = 'completed', completed_at = now() WHERE id % 10 <> 0"
    )
    env.conn.execute("ANALYZE cyclone_steps")
    env.conn.execute("ANALYZE cyclone_runs")
    now = env.now()
    lease = _plan(
        env.conn,
        "step_lease",
        {"lease": True, "worker": "w", "workflows": None, "ttl": 30, "now": now},
    )
    assert "cyclone_steps_available_idx" in lease
    deadlines = _plan(env.conn, "run_fail_deadline_passed", {"batch_size": 500, "now": now})
    assert "cyclone_runs_deadline_idx" in deadlines
    leases = _plan(env.conn, "lease_reclaim_expired", {"batch_size": 500, "now": now})
    assert "cyclone_steps_lease_idx" in leases


def test_connect_gives_autocommit_dict_rows(env: TestEnv):
    with connect(env.dsn) as conn:
        assert conn.autocommit
        assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}


def test_fragments_are_included_once_and_an_unknown_one_is_an_error():
    from cyclone.sql import resolve_includes

    blocks = {
        "_tail": "SELECT 1;",
        "a": "-- include: _tail",
        "b": "WITH x AS (SELECT 2)\n-- include: _tail",
    }
    assert resolve_includes(blocks) == {"a": "SELECT 1;", "b": "WITH x AS (SELECT 2)\nSELECT 1;"}
    with pytest.raises(ValueError, match="no such fragment"):
        resolve_includes({"a": "-- include: _missing"})
    assert not any(name.startswith("_") for name in QUERIES)

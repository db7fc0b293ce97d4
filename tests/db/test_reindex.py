"""The reindex sweep (cyclone/engine/sweeps.py): a queue index that a drained backlog left
bloated is rebuilt (REINDEX INDEX CONCURRENTLY), one a pass; a full one, a small one, one of a
table too big, and any while another scanner is at it, behind a pooler, in a transaction or
under a role that may not, are left alone; a failed rebuild fails no pass, its invalid leftover
is dropped at the next check and the index waits its hour; only invalid leftovers of ours go.

The backlog is made of step rows inserted as the engine's statements make them (available, in
pass order) under a run id of their own, then deleted, then VACUUMed: what retention leaves of
a drained backlog, in about a second.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import cyclone
from cyclone import engine
from cyclone.db import connect
from cyclone.engine import sweeps
from cyclone.engine.sweeps import REINDEX_FLOOR, REINDEX_RATIO
from cyclone.migrate import migrate
from cyclone.sql import QUERIES
from cyclone.testing import TestEnv

tasks = cyclone.Workflow("reindex-task")


@tasks.task()
def one(ctx):
    return 1


READY = "cyclone_steps_ready_idx"
AVAILABLE = "cyclone_steps_available_idx"
# 40,000 entries: 2.0 MiB of the ready index and 1.3 of the available one, both over the floor.
BACKLOG = 40_000
BACKLOG_INSERT = """
INSERT INTO cyclone_steps (run_id, workflow, node, kind, item_index, state, max_attempts,
                           available_at, created_at, pass)
SELECT %(run_id)s, %(workflow)s, 'backlog', 'task', i, 'available', 1, now(), now(), i
  FROM generate_series(1, %(n)s) AS i
"""
INDEX = """
SELECT c.relpages::bigint * current_setting('block_size')::int AS counted, c.reltuples,
       pg_relation_size(c.oid) AS bytes, c.relfilenode, x.indisvalid AS valid
  FROM pg_class c JOIN pg_index x ON x.indexrelid = c.oid
 WHERE c.relname = %(name)s AND c.relnamespace = current_schema()::regnamespace
"""


@pytest.fixture
def env(env: TestEnv) -> TestEnv:
    env.register(tasks)
    return env


def index(conn: psycopg.Connection, name: str) -> dict | None:
    return conn.execute(INDEX, {"name": name}).fetchone()


def backlog(conn: psycopg.Connection, n: int = BACKLOG) -> None:
    conn.execute(BACKLOG_INSERT, {"run_id": uuid.uuid4(), "workflow": tasks.name, "n": n})


def drain(conn: psycopg.Connection) -> None:
    """The backlog's rows deleted and VACUUMed, until the ready index's figures say they are
    gone (a snapshot another session held a moment keeps them from the first VACUUM)."""
    conn.execute("DELETE FROM cyclone_steps WHERE node = 'backlog'")
    live = conn.execute("SELECT count(*) AS n FROM cyclone_steps WHERE state = 'available'")
    live = live.fetchone()["n"]
    for _ in range(100):
        conn.execute("VACUUM cyclone_steps")
        found = index(conn, READY)
        if found["counted"] == found["bytes"] and found["reltuples"] <= live:
            return
        time.sleep(0.05)
    raise AssertionError("VACUUM left the backlog's entries counted")


def bloated(conn: psycopg.Connection, name: str) -> bool:
    """What the sweep finds too, read here from the same figures: over the floor and the ratio
    (at the ready index's 50 bytes an entry, the larger of the two)."""
    found = index(conn, name)
    return (
        found["counted"] >= REINDEX_FLOOR
        and found["counted"] > REINDEX_RATIO * max(found["reltuples"], 1) * 50
    )


def sweep_logs(caplog: pytest.LogCaptureFixture, level: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == sweeps.__name__ and r.levelname == level and "reindex" in r.getMessage()
    ]


def test_an_index_a_drained_backlog_left_bloated_is_rebuilt_one_a_pass(env, caplog) -> None:
    kept = [env.client.submit(tasks, {}) for _ in range(2)]
    backlog(env.conn)
    drain(env.conn)
    before = index(env.conn, READY)
    assert bloated(env.conn, READY) and bloated(env.conn, AVAILABLE)
    with caplog.at_level("INFO", logger=sweeps.__name__):
        assert engine.sweep_reindex(env.conn) == 1
    after = index(env.conn, READY)
    assert after["relfilenode"] != before["relfilenode"] and after["valid"]
    assert after["bytes"] < REINDEX_FLOOR <= before["bytes"]
    # One line: the index, its bytes before and after.
    (line,) = sweep_logs(caplog, "INFO")
    assert READY in line and f"{before['bytes']} bytes before, {after['bytes']} after" in line
    # The available index, as bloated, waits for the next pass.
    assert bloated(env.conn, AVAILABLE)
    # The steps still there are found through the new index, in lease order.
    with env.conn.transaction():
        env.conn.execute("SET LOCAL enable_seqscan = off")
        env.conn.execute("SET LOCAL enable_bitmapscan = off")
        query = (
            "SELECT run_id FROM cyclone_steps WHERE state = 'available' AND node_limit IS NULL"
            " ORDER BY priority, pass, id"
        )
        plan = "\n".join(r["QUERY PLAN"] for r in env.conn.execute(f"EXPLAIN {query}"))
        assert f"Index Scan using {READY} on cyclone_steps" in plan
        assert sorted(str(r["run_id"]) for r in env.conn.execute(query)) == sorted(kept)
    assert engine.lease_step(env.conn, worker="test", lease_ttl=30) is not None
    assert engine.sweep_reindex(env.conn) == 1
    assert not bloated(env.conn, AVAILABLE) and index(env.conn, AVAILABLE)["valid"]
    assert engine.sweep_reindex(env.conn) == 0  # nothing bloated is left


def test_an_index_that_is_big_because_its_backlog_is_still_there_is_kept(env) -> None:
    backlog(env.conn)
    env.conn.execute("ANALYZE cyclone_steps")  # the figures: its pages, and 40,000 entries
    before = index(env.conn, READY)
    assert before["counted"] >= REINDEX_FLOOR and before["reltuples"] > BACKLOG / 2
    assert engine.sweep_reindex(env.conn) == 0
    # Nor one whose entries were never counted (-1), whatever its pages.
    env.conn.execute(
        "UPDATE pg_class SET reltuples = -1 WHERE oid = %s::regclass", (READY,)
    )  # fmt: skip
    assert engine.sweep_reindex(env.conn) == 0
    assert index(env.conn, READY)["relfilenode"] == before["relfilenode"]


def test_a_small_index_is_never_rebuilt_however_empty(env) -> None:
    backlog(env.conn, 4_000)
    drain(env.conn)
    before = index(env.conn, READY)
    # Far over the ratio (no entry left), under the floor.
    assert before["reltuples"] == 0 and 8192 * 8 < before["counted"] < REINDEX_FLOOR
    assert engine.sweep_reindex(env.conn) == 0
    assert index(env.conn, READY)["relfilenode"] == before["relfilenode"]


def invalid_index(conn: psycopg.Connection, name: str) -> None:
    """An index left invalid by a concurrent build that failed (two available steps of one
    workflow make the unique build fail), as a failed REINDEX CONCURRENTLY leaves its _ccnew."""
    statement = sql.SQL(
        "CREATE UNIQUE INDEX CONCURRENTLY {} ON cyclone_steps (workflow) WHERE state = 'available'"
    ).format(sql.Identifier(name))
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(statement)
    assert index(conn, name)["valid"] is False


def test_an_index_of_a_table_too_big_to_read_within_the_timeout_is_left(
    env, caplog, monkeypatch
) -> None:
    backlog(env.conn)
    drain(env.conn)
    table = env.conn.execute("SELECT pg_relation_size('cyclone_steps') AS n").fetchone()["n"]
    monkeypatch.setattr(sweeps, "REINDEX_MAX_TABLE", table - 1)
    with caplog.at_level("WARNING", logger=sweeps.__name__):
        assert engine.sweep_reindex(env.conn) == 0
        assert engine.sweep_reindex(env.conn) == 0
    # Said once for each index (the ready and the available ones), then not again.
    warnings = sweep_logs(caplog, "WARNING")
    assert len(warnings) == 2 and f"{READY} is bloated" in warnings[0]
    assert f"REINDEX INDEX CONCURRENTLY {env.schema}.{READY}" in warnings[0]
    monkeypatch.setattr(sweeps, "REINDEX_MAX_TABLE", table)
    assert engine.sweep_reindex(env.conn) == 1


def test_only_the_invalid_leftovers_of_our_own_rebuilds_are_dropped(env, caplog) -> None:
    for _ in range(2):
        env.client.submit(tasks, {})
    invalid_index(env.conn, f"{READY}_ccnew")
    invalid_index(env.conn, f"{AVAILABLE}_ccold1")
    invalid_index(env.conn, "cyclone_steps_mine_ccnew")  # not named after a queue index
    env.conn.execute(f"CREATE INDEX {READY}_ccnew1 ON cyclone_steps (id)")  # valid: someone's
    with caplog.at_level("INFO", logger=sweeps.__name__):
        assert engine.sweep_reindex(env.conn) == 0  # nothing rebuilt
    assert index(env.conn, f"{READY}_ccnew") is None
    assert index(env.conn, f"{AVAILABLE}_ccold1") is None
    assert index(env.conn, "cyclone_steps_mine_ccnew")["valid"] is False
    assert index(env.conn, f"{READY}_ccnew1")["valid"] is True
    assert len(sweep_logs(caplog, "INFO")) == 2


def test_one_scanner_at_a_time_and_the_lock_is_released(env) -> None:
    for _ in range(2):
        env.client.submit(tasks, {})
    invalid_index(env.conn, f"{READY}_ccnew")
    with connect(env.dsn) as other:
        assert other.execute(QUERIES["reindex_lock"]).fetchone()["locked"]
        assert engine.sweep_reindex(env.conn) == 0
        assert index(env.conn, f"{READY}_ccnew") is not None  # the other scanner's turn
        other.execute(QUERIES["reindex_unlock"])
        assert engine.sweep_reindex(env.conn) == 0
        assert index(env.conn, f"{READY}_ccnew") is None
        # Released once done: the other scanner takes it.
        assert other.execute(QUERIES["reindex_lock"]).fetchone()["locked"]


def test_a_failed_rebuild_fails_no_pass_its_leftover_goes_and_it_waits(env, caplog) -> None:
    env.client.submit(tasks, {})
    backlog(env.conn)
    drain(env.conn)
    with connect(env.dsn) as writer:
        # A writer's transaction on the table: the rebuild waits for it after making its new
        # index, until the statement_timeout (the scanner's: 30 s) cancels it.
        writer.execute("BEGIN")
        writer.execute("LOCK TABLE cyclone_steps IN ROW EXCLUSIVE MODE")
        env.conn.execute("SET statement_timeout = '300ms'")
        with caplog.at_level("WARNING", logger=sweeps.__name__):
            assert engine.sweep_reindex(env.conn) == 0
        writer.execute("COMMIT")
    env.conn.execute("RESET statement_timeout")
    (warning,) = sweep_logs(caplog, "WARNING")
    assert f"rebuilding {READY} failed" in warning
    assert index(env.conn, f"{READY}_ccnew")["valid"] is False
    # The next check drops the leftover and, the ready index waiting its hour, rebuilds the
    # next bloated one.
    assert engine.sweep_reindex(env.conn) == 1
    assert index(env.conn, f"{READY}_ccnew") is None
    assert bloated(env.conn, READY) and not bloated(env.conn, AVAILABLE)
    assert engine.sweep_reindex(env.conn) == 0


def test_not_behind_a_pooler_nor_in_a_transaction(env, caplog, monkeypatch) -> None:
    for _ in range(2):
        env.client.submit(tasks, {})
    invalid_index(env.conn, f"{READY}_ccnew")
    with caplog.at_level("INFO", logger=sweeps.__name__), env.conn.transaction():
        assert engine.sweep_reindex(env.conn) == 0
    assert sweep_logs(caplog, "INFO") == sweep_logs(caplog, "WARNING") == []
    # A pooler's session: the server process that answers is not the one connected to.
    monkeypatch.setattr(psycopg.ConnectionInfo, "backend_pid", property(lambda self: -1))
    with caplog.at_level("WARNING", logger=sweeps.__name__):
        assert engine.sweep_reindex(env.conn) == 0
        assert engine.sweep_reindex(env.conn) == 0
    (warning,) = sweep_logs(caplog, "WARNING")
    assert "pooler" in warning
    assert index(env.conn, f"{READY}_ccnew") is not None
    # Nor is the lock left taken.
    assert env.conn.execute(QUERIES["reindex_lock"]).fetchone()["locked"]
    env.conn.execute(QUERIES["reindex_unlock"])


@dataclass
class Roles:
    base: str
    schema: str
    owner: str
    runtime: str

    def dsn(self, role: str) -> str:
        return make_conninfo(self.base, user=role, options=f"-c search_path={self.schema}")


@pytest.fixture
def roles(pg_dsn: str) -> Iterator[Roles]:
    """A schema migrated by an owning role, and a runtime role given the printed GRANTs."""
    tag = uuid.uuid4().hex[:8]
    r = Roles(pg_dsn, f"cyclone_reindex_{tag}", f"mig_{tag}", f"run_{tag}")
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        for role in (r.owner, r.runtime):
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(
            sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                sql.Identifier(r.schema), sql.Identifier(r.owner)
            )
        )
    try:
        with connect(r.dsn(r.owner)) as conn:
            migrate(conn)
            ids = {k: sql.Identifier(v) for k, v in
                   {"schema": r.schema, "migrator": r.owner, "runtime": r.runtime,
                    "readonly": r.owner}.items()}  # fmt: skip
            conn.execute(sql.SQL(QUERIES["grants_print"]).format(**ids).as_string(conn).encode())
        yield r
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(r.schema)))
            for role in (r.owner, r.runtime):
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_role_that_may_not_rebuild_says_so_once_and_fails_no_pass(roles, caplog) -> None:
    with connect(roles.dsn(roles.owner)) as owner, connect(roles.dsn(roles.runtime)) as runtime:
        backlog(owner)
        drain(owner)
        assert bloated(owner, READY)
        with caplog.at_level("WARNING", logger=sweeps.__name__):
            assert engine.sweep_reindex(runtime) == 0
            assert engine.sweep_reindex(runtime) == 0
        (warning,) = sweep_logs(caplog, "WARNING")
        assert f"role {roles.runtime} may not rebuild" in warning
        assert bloated(owner, READY)
        # MAINTAIN on the table (PostgreSQL 17) is enough to rebuild; the owner always may.
        if runtime.info.server_version >= 170000:
            grant = sql.SQL("GRANT MAINTAIN ON cyclone_steps TO {}")
            owner.execute(grant.format(sql.Identifier(roles.runtime)))
            assert engine.sweep_reindex(runtime) == 1
        assert engine.sweep_reindex(owner) == 1

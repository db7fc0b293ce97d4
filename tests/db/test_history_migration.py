"""Migration 18 on a database that already holds runs (issue 25): it commits while live
transactions write the hot tables (it takes no lock on them that a write would conflict with),
and the runs finished before it move to history afterwards, batch by batch, like new ones."""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta

import psycopg
import pytest

from cyclone import engine
from cyclone.migrate import migrate
from cyclone.sql import migrations

HISTORY = 18
# The module (the package exports its function under the same name).
migrate_module = sys.modules["cyclone.migrate"]

# An existing database's runs, made as the engine leaves them: `n` one-step runs, most ended
# an hour ago (one in ten failed, one in ten with an idempotency key), and 50 still running.
SEED = """
INSERT INTO cyclone_graphs (hash, workflow, graph) VALUES ('h', 'old', '{}');
INSERT INTO cyclone_workflows (name, graph_hash) VALUES ('old', 'h');
INSERT INTO cyclone_runs (id, workflow, graph_hash, state, input, output, idempotency_key,
                          created_at, finished_at, pass)
SELECT gen_random_uuid(), 'old', 'h',
       CASE WHEN i <= 50 THEN 'running' WHEN i % 10 = 0 THEN 'failed' ELSE 'completed' END,
       '{}', CASE WHEN i > 50 AND i % 10 <> 0 THEN '{"s1": 1}'::jsonb END,
       CASE WHEN i % 10 = 5 THEN 'key-' || i END,
       now() - interval '2 hours',
       CASE WHEN i > 50 THEN now() - interval '1 hour' + i * interval '1 ms' END,
       CASE WHEN i <= 50 THEN i ELSE -1 END
  FROM generate_series(1, %(n)s) AS i;
INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, attempt, max_attempts,
                           available_at, created_at, completed_at, error_kind, error)
SELECT r.id, 'old', 's1', 'task',
       CASE r.state WHEN 'running' THEN 'available' WHEN 'failed' THEN 'dead'
                    ELSE 'completed' END,
       1, 1, r.created_at, r.created_at, r.finished_at,
       CASE WHEN r.state = 'failed' THEN 'error' END,
       CASE WHEN r.state = 'failed' THEN 'boom' END
  FROM cyclone_runs r;
"""


@pytest.fixture
def before_history(scratch_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A schema at every migration but 18, holding runs."""
    every = migrations()
    monkeypatch.setattr(migrate_module, "migrations", lambda: [m for m in every if m[0] != HISTORY])
    with psycopg.connect(scratch_dsn, autocommit=True) as conn:
        # File by file: schema.sql, which a new schema is otherwise made from, has 18 in it.
        migrate(conn, each_file=True)
        conn.execute(SEED.replace("%(n)s", "2000").encode())  # a fixed script, no parameters
    monkeypatch.setattr(migrate_module, "migrations", lambda: every)
    return scratch_dsn


def test_the_migration_commits_beside_live_writes_to_the_hot_tables(before_history: str):
    with psycopg.connect(before_history) as writer:
        # A worker's transaction, left open: it holds the row locks and ROW EXCLUSIVE locks
        # of a lease on the hot tables while the migration runs.
        writer.execute(
            "UPDATE cyclone_steps SET state = 'running', attempt = attempt + 1,"
            " lease_token = gen_random_uuid(), lease_expires_at = now() + interval '30s'"
            " WHERE id = (SELECT min(id) FROM cyclone_steps WHERE state = 'available')"
        )
        writer.execute("UPDATE cyclone_runs SET waited = true WHERE state = 'running'")
        with psycopg.connect(before_history, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '2s'")
            started = time.monotonic()
            assert migrate(conn) == [HISTORY]
            took = time.monotonic() - started
        writer.rollback()
    assert took < 2


def test_runs_finished_before_the_migration_move_to_history_after_it(before_history: str):
    with psycopg.connect(before_history, autocommit=True) as conn:
        migrate(conn)
    with psycopg.connect(before_history, row_factory=psycopg.rows.dict_row) as conn:
        moved = 0
        while batch := engine.sweep_history(
            conn, history_after=10, retention=86400, batch_size=500
        ):
            moved += batch
        # 1,950 ended: 195 failed and 195 keyed stay hot, the other 1,560 moved.
        assert moved == 1560
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM cyclone_runs) AS hot,"
            " (SELECT count(*) FROM cyclone_history_runs) AS moved,"
            " (SELECT count(*) FROM cyclone_history_steps) AS steps,"
            " (SELECT count(*) FROM cyclone_v_runs) AS seen"
        ).fetchone()
        assert counts == {"hot": 440, "moved": 1560, "steps": 1560, "seen": 2000}
        # An hour ago in partitions of three hours (a day's retention / 8).
        spans = conn.execute("SELECT hi - lo AS span FROM cyclone_history_partitions").fetchall()
        assert {s["span"] for s in spans} == {timedelta(hours=3)}


def test_a_lease_waits_for_no_move(before_history: str):
    """A batch being moved holds locks on ended runs only: a lease of a live step goes on."""
    with psycopg.connect(before_history, autocommit=True) as conn:
        migrate(conn)
    mover = psycopg.connect(before_history, row_factory=psycopg.rows.dict_row)
    with mover, mover.transaction():
        mover.execute("SELECT cyclone_history_move(10, 86400, 2000, NULL)")
        done = threading.Event()

        def lease() -> None:
            with psycopg.connect(
                before_history, autocommit=True, row_factory=psycopg.rows.dict_row
            ) as worker:
                worker.execute("SET lock_timeout = '2s'")
                assert engine.lease_step(worker, worker="w", lease_ttl=30) is not None
            done.set()

        thread = threading.Thread(target=lease)
        thread.start()
        thread.join(10)
        assert done.is_set()

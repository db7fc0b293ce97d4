"""Migration 25 on a database whose cancelled runs left held steps behind: those steps stop
being held (the next admission of their node would have failed on them), the steps still
waiting for a slot stay held, and the node admits them as before."""

from __future__ import annotations

import sys

import psycopg
import pytest

from cyclone.migrate import migrate
from cyclone.sql import migrations

ADMISSION = 25
migrate_module = sys.modules["cyclone.migrate"]

# A node limited to one step at a time: one step in its slot, one held, and one held step of a
# run cancelled under version 24 (discarded, `held` left set).
SEED = """
INSERT INTO cyclone_graphs (hash, workflow, graph)
VALUES ('h', 'old', '{"nodes": [{"name": "s1", "kind": "task", "concurrency": 1}]}');
INSERT INTO cyclone_workflows (name, graph_hash) VALUES ('old', 'h');
INSERT INTO cyclone_runs (id, workflow, graph_hash, state, input, created_at, finished_at, pass)
VALUES ('00000000-0000-0000-0000-000000000001', 'old', 'h', 'running', '{}', now(), NULL, 1),
       ('00000000-0000-0000-0000-000000000002', 'old', 'h', 'running', '{}', now(), NULL, 2),
       ('00000000-0000-0000-0000-000000000003', 'old', 'h', 'cancelled', '{}', now(), now(), -3);
INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, max_attempts, available_at,
                           created_at, node_limit, pass)
SELECT ('00000000-0000-0000-0000-00000000000' || i)::uuid, 'old', 's1', 'task', 'available',
       1, now(), now(), 1, i
  FROM generate_series(1, 3) AS i;
UPDATE cyclone_steps SET state = 'discarded', error_kind = 'cancelled', completed_at = now()
 WHERE run_id = '00000000-0000-0000-0000-000000000003';
"""


@pytest.fixture
def at_version_24(scratch_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    every = migrations()
    monkeypatch.setattr(
        migrate_module, "migrations", lambda: [m for m in every if m[0] < ADMISSION]
    )
    with psycopg.connect(scratch_dsn, autocommit=True) as conn:
        migrate(conn, each_file=True)
        conn.execute(SEED)
    monkeypatch.setattr(migrate_module, "migrations", lambda: every)
    return scratch_dsn


def _steps(conn: psycopg.Connection) -> list[tuple[str, bool]]:
    return conn.execute("SELECT state, held FROM cyclone_steps ORDER BY pass").fetchall()


def test_held_steps_of_ended_runs_are_let_go_and_the_node_admits_the_rest(at_version_24: str):
    with psycopg.connect(at_version_24, autocommit=True) as conn:
        assert _steps(conn) == [("available", False), ("waiting", True), ("discarded", True)]
        assert migrate(conn)[0] == ADMISSION  # and any later migration
        assert _steps(conn) == [("available", False), ("waiting", True), ("discarded", False)]
        # The slot frees: the waiting step is admitted, and nothing fails on the discarded one.
        conn.execute(
            "UPDATE cyclone_steps SET state = 'completed', completed_at = now() WHERE pass = 1"
        )
        assert _steps(conn) == [("completed", False), ("available", False), ("discarded", False)]

"""Migration 25 on a database whose cancelled runs left held steps behind: those steps stop
being held (the next admission of their node would have failed on them), and the node goes
on. Migration 33 on steps that held slots as version 32 counted them: a running step claims a
slot, one held for a slot alone waits available, one held for a token stays held."""

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
        assert migrate(conn)[0] == ADMISSION  # and every later migration
        # The step that waited for a slot waits available since migration 33 (a lease claims
        # the slot), and nothing fails on the discarded one.
        assert _steps(conn) == [("available", False), ("available", False), ("discarded", False)]
        conn.execute(
            "UPDATE cyclone_steps SET state = 'completed', completed_at = now() WHERE pass = 1"
        )
        assert _steps(conn) == [("completed", False), ("available", False), ("discarded", False)]


SLOTS = 33
# Version 32: a node limited to two at once with one step running, one available (both holding
# a slot as version 32 counted), one held for a slot; and a node limited by concurrency and
# rate with a step held for both.
SEED_32 = """
INSERT INTO cyclone_graphs (hash, workflow, graph)
VALUES ('h', 'old', '{"nodes": [{"name": "s1", "kind": "task", "concurrency": 2},
                                {"name": "s2", "kind": "task", "concurrency": 3,
                                 "rate_limit": "r"}]}');
INSERT INTO cyclone_workflows (name, graph_hash) VALUES ('old', 'h');
INSERT INTO cyclone_runs (id, workflow, graph_hash, state, input, created_at, pass)
SELECT ('00000000-0000-0000-0000-00000000000' || i)::uuid, 'old', 'h', 'running', '{}', now(), i
  FROM generate_series(1, 4) AS i;
INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, max_attempts, available_at,
                           created_at, node_limit, rate_limit, pass, attempt, lease_token,
                           lease_expires_at, started_at)
VALUES ('00000000-0000-0000-0000-000000000001', 'old', 's1', 'task', 'running', 1, now(),
        now(), 2, NULL, 1, 1, gen_random_uuid(), now() + interval '1 minute', now()),
       ('00000000-0000-0000-0000-000000000002', 'old', 's1', 'task', 'available', 1, now(),
        now(), 2, NULL, 2, 0, NULL, NULL, NULL),
       ('00000000-0000-0000-0000-000000000003', 'old', 's1', 'task', 'available', 1, now(),
        now(), 2, NULL, 3, 0, NULL, NULL, NULL),
       ('00000000-0000-0000-0000-000000000004', 'old', 's2', 'task', 'available', 1, now(),
        now(), 3, 'r', 4, 0, NULL, NULL, NULL);
"""


@pytest.fixture
def at_version_32(scratch_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    every = migrations()
    monkeypatch.setattr(migrate_module, "migrations", lambda: [m for m in every if m[0] < SLOTS])
    with psycopg.connect(scratch_dsn, autocommit=True) as conn:
        migrate(conn, each_file=True)
        conn.execute(SEED_32)
    monkeypatch.setattr(migrate_module, "migrations", lambda: every)
    return scratch_dsn


def test_migration_33_gives_running_steps_slots_and_lets_steps_held_for_one_wait_available(
    at_version_32: str,
):
    with psycopg.connect(at_version_32, autocommit=True) as conn:
        # Version 32 held the third step for a slot, and the fourth for both limits.
        assert _steps(conn) == [("running", False), ("available", False), ("waiting", True),
                                ("waiting", True)]  # fmt: skip
        assert migrate(conn)[0] == SLOTS
        assert _steps(conn) == [("running", False), ("available", False), ("available", False),
                                ("waiting", True)]  # fmt: skip
        slots = conn.execute(
            "SELECT node, slot, step_id IS NOT NULL AS held FROM cyclone_node_slots"
            " ORDER BY node, slot"
        ).fetchall()
        assert slots == [("s1", 1, True), ("s1", 2, False), ("s2", 1, False), ("s2", 2, False),
                         ("s2", 3, False)]  # fmt: skip
        # The running step's end lets its slot go.
        conn.execute(
            "UPDATE cyclone_steps SET state = 'completed', completed_at = now(),"
            " lease_token = NULL, lease_expires_at = NULL WHERE pass = 1"
        )
        assert conn.execute(
            "SELECT count(*) FROM cyclone_node_slots WHERE step_id IS NOT NULL"
        ).fetchone() == (0,)

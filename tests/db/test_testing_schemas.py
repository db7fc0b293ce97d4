"""TestEnv's schemas made ahead and dropped behind (cyclone.testing_schemas): every schema the
keeper makes or is given is gone once it settles, a schema it could not drop is named, and a
TestEnv on a schema made ahead is a TestEnv like any other."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import psycopg
import pytest

import cyclone
from cyclone import testing_schemas
from cyclone.migrate import migrate
from cyclone.sql import migrations
from cyclone.testing import TestEnv
from cyclone.testing_schemas import SchemaKeeper

migrate_module = sys.modules["cyclone.migrate"]


def schemas_present(dsn: str, names: list[str]) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s) ORDER BY nspname", (names,)
        ).fetchall()
    return [r[0] for r in rows]


def wait_made(keeper: SchemaKeeper, timeout: float = 10) -> None:
    """Until a schema made ahead is ready, not taking it."""
    deadline = time.monotonic() + timeout
    while keeper._spare is None:
        assert time.monotonic() < deadline, "no schema made ahead"
        time.sleep(0.01)


def made_ahead(keeper: SchemaKeeper, timeout: float = 10) -> str:
    """The next schema made ahead (asked for by the first take)."""
    deadline = time.monotonic() + timeout
    while (name := keeper.take()) is None:
        assert time.monotonic() < deadline, "no schema made ahead"
        time.sleep(0.01)
    return name


@pytest.fixture
def keeper(pg_dsn: str) -> Iterator[SchemaKeeper]:
    k = SchemaKeeper(pg_dsn)
    yield k
    assert k.settle() == []


def test_a_schema_made_ahead_is_migrated_and_gone_once_dropped_and_settled(pg_dsn, keeper):
    name = made_ahead(keeper)
    other = made_ahead(keeper)  # the one after, made while the first was in use
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (name,))
        # Current: migrate finds nothing to do; every version is recorded.
        assert migrate(conn) == []
        versions = [r[0] for r in conn.execute("SELECT version FROM cyclone_migrations")]
        assert versions == [v for v, _, _ in migrations()]
    assert keeper.drop(name)
    wait_made(keeper)  # one more made ahead, never taken
    spare = keeper._spare
    assert keeper.settle() == []
    # Given back or never taken: dropped. Taken and not given back: the taker's.
    assert schemas_present(pg_dsn, [name, other, spare]) == [other]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {other} CASCADE")


def test_a_schema_made_while_a_test_patches_the_migrations_has_every_version(pg_dsn, keeper):
    """The keeper read schema.sql and the versions when it started: a test that migrates a
    schema to an older version meanwhile (test_history_migration) changes no schema it makes."""
    every = migrations()
    migrate_module.migrations = lambda: every[:2]  # type: ignore[attr-defined]
    try:
        name = made_ahead(keeper)
    finally:
        migrate_module.migrations = migrations  # type: ignore[attr-defined]
    with psycopg.connect(pg_dsn) as conn:
        versions = conn.execute(
            f"SELECT array_agg(version ORDER BY version) FROM {name}.cyclone_migrations"
        ).fetchone()
    assert versions == ([v for v, _, _ in every],)
    assert keeper.drop(name)


def test_a_schema_that_cannot_be_dropped_is_named_when_the_keeper_settles(pg_dsn):
    keeper = SchemaKeeper(pg_dsn)
    name = made_ahead(keeper)
    with psycopg.connect(pg_dsn) as holder:
        # A session left in a transaction on the schema's table: the drop waits for it.
        holder.execute(f"SELECT count(*) FROM {name}.cyclone_runs")
        assert keeper.drop(name)
        failures = keeper.settle(timeout=0.5)
        assert len(failures) == 1 and name in failures[0]
        holder.rollback()
    # Once the holder is gone, the drop that waited goes through.
    assert keeper.settle() == []
    assert schemas_present(pg_dsn, [name]) == []


def test_a_drop_goes_through_after_the_keepers_session_was_ended(pg_dsn, keeper):
    name = made_ahead(keeper)
    wait_made(keeper)  # the keeper is idle: the drop below is its next statement
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        ended = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s"
            " AND datname = current_database()",
            (testing_schemas.APPLICATION_NAME,),
        ).fetchall()
    assert ended  # the session that made the schema
    assert keeper.drop(name)
    assert keeper.settle() == []
    assert schemas_present(pg_dsn, [name]) == []


def test_a_settled_keeper_hands_out_nothing_and_queues_no_drop(pg_dsn, keeper):
    assert keeper.settle() == []
    assert keeper.take() is None
    assert not keeper.drop("cyclone_test_never_made")


def test_testenvs_on_schemas_made_ahead_run_workflows_and_leave_nothing(
    pg_dsn, keeper, monkeypatch
):
    wf = cyclone.Workflow("made-ahead")

    @wf.task()
    def one(ctx):
        return 1

    monkeypatch.setattr(testing_schemas, "keeper_for", lambda base, session: keeper)
    keeper.take()  # the first one asked for
    used = []
    for _ in range(3):
        wait_made(keeper)
        ahead = keeper._spare
        with TestEnv([wf], dsn=pg_dsn) as env:
            assert env.schema == ahead
            used.append(env.schema)
            run_id = env.client.submit(wf, {})
            assert env.run_until_complete(run_id).output == {"one": 1}
            assert migrate(env.conn) == []
    assert keeper.settle() == []
    assert schemas_present(pg_dsn, used) == []


def test_the_sessions_testenvs_take_schemas_from_its_keeper(env: TestEnv):
    """tests/conftest.py turned schemas_in_background() on for the session's test server."""
    assert env._keeper is not None and env._keeper is testing_schemas._keeper

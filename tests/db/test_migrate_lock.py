"""`migrate` takes its lock only when a migration is pending, and waits for it a bounded time
(issue 22, item 11: any role holding that advisory lock stopped every start-up)."""

from __future__ import annotations

import sys
import time

import psycopg
import pytest
from cli_support import run_cli

from cyclone.db import with_options
from cyclone.migrate import MigrationLocked, migrate
from cyclone.testing import TestEnv

HOLD = "SELECT pg_advisory_lock(hashtext(current_schema() || '.cyclone_migrations'))"


def test_a_current_schema_is_found_current_whoever_holds_the_lock(env: TestEnv):
    with psycopg.connect(env.dsn, autocommit=True) as holder:
        holder.execute(HOLD)
        # A statement timeout, so that a migrate that waits fails rather than hangs.
        with psycopg.connect(with_options(env.dsn, "-c statement_timeout=5000")) as conn:
            started = time.monotonic()
            assert migrate(conn) == []
            assert time.monotonic() - started < 2


def test_a_pending_migration_waits_for_the_lock_no_longer_than_its_timeout(scratch_dsn: str):
    with psycopg.connect(scratch_dsn, autocommit=True) as holder:
        holder.execute(HOLD)
        schema = holder.execute("SELECT current_schema()").fetchone()[0]
        with psycopg.connect(scratch_dsn, autocommit=True) as conn:
            started = time.monotonic()
            with pytest.raises(MigrationLocked, match=f"schema '{schema}' for over 0.5s"):
                migrate(conn, lock_timeout=0.5)
            assert 0.4 < time.monotonic() - started < 3
            assert conn.execute("SELECT to_regclass('cyclone_migrations')").fetchone() == (None,)
            # The session's own lock_timeout is as it was.
            assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
        holder.execute("SELECT pg_advisory_unlock_all()")
    with psycopg.connect(scratch_dsn, autocommit=True) as conn:
        assert migrate(conn, lock_timeout=0.5)  # free now: every migration applied
        assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)


def test_cyclone_migrate_exits_1_naming_the_lock_it_could_not_take(
    capsys, scratch_dsn: str, monkeypatch
):
    monkeypatch.setattr(sys.modules["cyclone.migrate"], "LOCK_TIMEOUT", 0.3)
    with psycopg.connect(scratch_dsn, autocommit=True) as holder:
        holder.execute(HOLD)
        done = run_cli(capsys, None, "--dsn", scratch_dsn, "migrate")
    assert (done.code, done.out) == (1, "")
    assert done.err.startswith("cyclone: another session has held the migration lock")
    assert done.err.count("\n") == 1

"""What a transaction-mode pooler needs (issue 16): which connections prepare statements, and
no lock that outlives its transaction. tests/process/test_pooler.py runs through a real one."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg.pq import TransactionStatus

from cyclone import db
from cyclone.child.session import check_statement_timeout
from cyclone.clients.client import Client
from cyclone.migrate import migrate
from cyclone.testing import TestEnv


@pytest.fixture
def unprepared() -> Iterator[None]:
    db.use_prepared_statements(False)
    try:
        yield
    finally:
        db.use_prepared_statements(True)


def test_connections_prepare_by_default(env: TestEnv) -> None:
    with db.connect(env.dsn) as conn:
        assert conn.prepare_threshold == 5


def test_the_process_setting_reaches_every_later_connection(env: TestEnv, unprepared) -> None:
    with db.connect(env.dsn) as conn:
        assert conn.prepare_threshold is None
        for _ in range(8):  # past psycopg's threshold: still nothing prepared on the server
            conn.execute("SELECT count(*) FROM cyclone_runs").fetchone()
        assert conn.execute("SELECT count(*) AS n FROM pg_prepared_statements").fetchone()["n"] == 0
    with Client(env.dsn) as client, client.connection() as pooled:
        assert pooled.prepare_threshold is None


def test_a_client_says_for_itself(env: TestEnv, tmp_path: Path) -> None:
    with Client(env.dsn, prepared_statements=False) as client, client.connection() as pooled:
        assert pooled.prepare_threshold is None
    config = tmp_path / "cyclone.toml"
    config.write_text(f"[database]\nurl = {env.dsn!r}\nprepared_statements = false\n")
    with Client.from_config(str(config)) as client, client.connection() as pooled:
        assert pooled.prepare_threshold is None
    with Client(env.dsn, prepared_statements=True) as client, client.connection() as pooled:
        assert pooled.prepare_threshold == 5


def test_migrations_lock_only_inside_their_transaction(scratch_dsn: str) -> None:
    # Behind the pooler, a session-level lock taken by one statement and released by another
    # may be taken and left on one server connection and "released" on another.
    locks: list[tuple[str, TransactionStatus]] = []
    with db.connect(scratch_dsn) as conn:
        execute = conn.execute

        def recording(query, *args, **kwargs):  # type: ignore[no-untyped-def]
            text = query.decode() if isinstance(query, bytes) else str(query)
            # The migrations' lock (a migration's own text, and schema.sql, which a new schema
            # is made from, name other advisory locks and the migrations table too).
            if "advisory" in text and "'.cyclone_migrations'" in text:
                locks.append((text, conn.info.transaction_status))
            return execute(query, *args, **kwargs)

        conn.execute = recording  # type: ignore[method-assign]
        assert migrate(conn)  # a fresh schema: every migration applied
        assert migrate(conn) == []
    assert len(locks) == 1  # the second call found nothing pending: no lock at all
    assert all(status == TransactionStatus.INTRANS for _, status in locks)
    assert all("pg_advisory_xact_lock" in text for text, _ in locks)


def test_a_statement_timeout_that_did_not_arrive_is_reported(
    env: TestEnv, caplog: pytest.LogCaptureFixture
) -> None:
    with db.connect(db.with_options(env.dsn, "-c statement_timeout=1500")) as conn:
        assert check_statement_timeout(conn, 1500)
    assert caplog.records == []
    # As behind PgBouncer with ignore_startup_parameters = options: the option never arrives.
    with caplog.at_level(logging.WARNING), db.connect(env.dsn) as conn:
        assert not check_statement_timeout(conn, 1500)
    assert "statement_timeout is 0 ms, not the 1500 ms asked for" in caplog.text

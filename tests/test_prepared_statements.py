"""`[database] prepared_statements`: which connections may prepare (issue 16)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cyclone import db
from cyclone.client import Client
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

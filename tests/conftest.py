from __future__ import annotations

import uuid

import psycopg
import pytest

from cyclone.testing import TestEnv, server_dsn


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    """The test server: CYCLONE_TEST_DSN, else the embedded one, started once per session."""
    return server_dsn()


@pytest.fixture
def env(pg_dsn: str):
    with TestEnv(dsn=pg_dsn) as e:
        yield e


@pytest.fixture
def scratch_dsn(pg_dsn: str):
    """A DSN on an empty schema of its own, dropped afterwards."""
    schema = f"cyclone_scratch_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    try:
        yield psycopg.conninfo.make_conninfo(pg_dsn, options=f"-c search_path={schema}")
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")

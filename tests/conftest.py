from __future__ import annotations

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

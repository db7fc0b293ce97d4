"""tests/unit: no database and no process. A test that needs either belongs in tests/db or
tests/process; these fixtures say so instead of starting the server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fakes import Harness

from cyclone.testing import server_dsn


@pytest.fixture
def h() -> Harness:
    """An arbiter on fake ports (tests/fakes.py), with the default config."""
    return Harness()


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    pytest.fail("tests/unit has no database: a test that needs one belongs in tests/db")


@pytest.fixture(autouse=True)
def _no_test_server() -> Iterator[None]:
    """TestEnv() and cyclone_env ask server_dsn() directly: fail a unit test that did."""
    asked = server_dsn.cache_info()
    yield
    now = server_dsn.cache_info()
    if now.hits + now.misses > asked.hits + asked.misses:
        pytest.fail("tests/unit has no database: this test asked for the test server (TestEnv?)")

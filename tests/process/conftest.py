"""Fixtures of the process tests: a real supervisor subprocess on the test's own schema."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from proc_helpers import SupervisorProcess

from cyclone.testing import TestEnv


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

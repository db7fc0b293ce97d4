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

    def start(workers: int = 2, shutdown: str = "5s") -> SupervisorProcess:
        proc = SupervisorProcess(env, tmp_path, f"supervisor{len(started)}", workers, shutdown)
        started.append(proc)
        proc.wait_ready(workers)
        return proc

    yield start
    for proc in started:
        proc.stop()

"""Which processes a test started, so that the suite can hold such tests to the `process` marker.

`install()` wraps the ways this interpreter starts a process (os.fork, os.forkpty,
os.posix_spawn[p], os.system, subprocess.Popen) with a note of what was started; each wrapper
still calls the real function. The root conftest watches every test (its setup, call and
teardown) and fails one that started a process without the marker, so that
`pytest -m "not process"` stays a loop without processes.

The embedded test server that the session starts on first use (`pg_dsn`, `TestEnv()`) is not
the test's doing: spawns under `cyclone.embedded.ensure_test_server` are not counted.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_started: list[str] | None = None  # what the watched test started; None: nobody watches


def _session_server() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "ensure_test_server":
            return True
        frame = frame.f_back
    return False


def _noting(what: str, real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _started is not None and not _session_server():
            shown = args[1:2] if what == "subprocess.Popen" else args[:1]
            _started.append(" ".join([what, *map(repr, shown)])[:200])
        return real(*args, **kwargs)

    wrapper.__spawn_guard__ = True  # type: ignore[attr-defined]
    return wrapper


def install() -> None:
    """Wrap the process-starting functions, once per interpreter."""
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        real = getattr(os, name, None)
        if real is not None and not hasattr(real, "__spawn_guard__"):
            setattr(os, name, _noting(f"os.{name}", real))
    execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    if not hasattr(execute, "__spawn_guard__"):
        subprocess.Popen._execute_child = _noting("subprocess.Popen", execute)  # type: ignore[attr-defined]


@contextmanager
def watching() -> Iterator[list[str]]:
    """The processes started inside the block (by this process: a forked child's own spawns
    are its business)."""
    global _started
    outer, _started = _started, []
    try:
        yield _started
    finally:
        _started = outer

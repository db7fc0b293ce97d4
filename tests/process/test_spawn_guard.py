"""The guard behind the `process` marker (tests/spawn_guard.py) sees every way a test starts a
process, and not the test server the session starts for it."""

from __future__ import annotations

import os
import subprocess
import sys

import spawn_guard


def test_the_guard_notes_a_fork_and_a_subprocess() -> None:
    with spawn_guard.watching() as started:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert started[0] == "os.fork"
    assert started[1].startswith("subprocess.Popen [") and "'-c', 'pass'" in started[1]


def test_the_session_test_server_is_not_the_tests_doing() -> None:
    def ensure_test_server() -> None:  # named as cyclone.embedded's
        subprocess.run([sys.executable, "-c", "pass"], check=True)

    with spawn_guard.watching() as started:
        ensure_test_server()
        assert started == []
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert len(started) == 1

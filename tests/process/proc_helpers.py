"""Helpers of the process tests: real supervisors, and their processes watched in /proc."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from cyclone.testing import TestEnv

HERE = Path(__file__).parent
T = TypeVar("T")

# Sub-second everything, so kills, retries and reclaims happen within a test's patience.
CONFIG = """
[database]
migrate = false
[supervisor]
workers = {workers}
kill_grace = "300ms"
shutdown_timeout = "{shutdown_timeout}"
[worker]
lease_ttl = "3s"
heartbeat_interval = "500ms"
poll_interval = "100ms"
[scanner]
interval = "200ms"
[metrics]
port = 0
[workflows]
modules = ["proc_flows"]
[logging]
level = "debug"
"""


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll until `condition()` is truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields after the command (which may hold spaces): state ppid pgrp ...
    return text.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def processes() -> Iterator[tuple[int, list[str]]]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[0] not in ("Z", "X"):
                yield int(entry.name), fields


def group_members(pgid: int) -> list[int]:
    return [pid for pid, fields in processes() if int(fields[2]) == pgid]


def children(ppid: int) -> list[int]:
    return [pid for pid, fields in processes() if int(fields[1]) == ppid]


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


class SupervisorProcess:
    def __init__(self, env: TestEnv, tmp: Path, name: str, workers: int, shutdown: str) -> None:
        self.config = tmp / f"{name}.toml"
        self.config.write_text(CONFIG.format(workers=workers, shutdown_timeout=shutdown))
        self.log_path = tmp / f"{name}.log"
        environ = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            CYCLONE_DATABASE_URL=env.dsn,
        )
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "cyclone.supervisor", "--config", str(self.config)],
                env=environ, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.pid = self.popen.pid
        self.seen: set[int] = set()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        found = re.search(r"metrics at (http://\S+)", self.log())
        assert found, self.log()
        with urllib.request.urlopen(found.group(1), timeout=5) as response:
            return response.read().decode()

    def workers(self) -> list[int]:
        found = [pid for pid in children(self.pid) if title(pid).startswith("cyclone worker")]
        self.seen.update(found)
        return found

    def scanners(self) -> list[int]:
        return [pid for pid in children(self.pid) if title(pid) == "cyclone scanner"]

    def wait_ready(self, workers: int) -> list[int]:
        return wait_for(
            lambda: len(self.workers()) == workers and self.scanners() and self.workers(),
            15, f"{workers} workers and a scanner\n{self.log()}",
        )  # fmt: skip

    def stop(self) -> None:
        pids = set(self.seen) | set(children(self.pid))
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)
        for pid in pids:  # workers die with the supervisor; their groups must go too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

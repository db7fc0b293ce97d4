"""A `cyclone-supervisor` subprocess for the benches: its config written to a file, its output
to a log, and its READY=1 awaited on a NOTIFY_SOCKET of its own, as systemd would.

The bench folder goes first on the supervisor's PYTHONPATH, so that `[workflows] modules`
can name a bench script (runtime, pooler, backlog).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class Supervisor:
    """Started on `dsn` with the TOML text `config`; files named `name` in `tmp`."""

    def __init__(
        self, dsn: str, tmp: Path, config: str, name: str = "supervisor", wait: bool = True
    ) -> None:
        path = tmp / f"{name}.toml"
        path.write_text(config)
        sock_path = str(tmp / f"{name}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(sock_path)
        self.sock.settimeout(60)
        environ = dict(
            os.environ, CYCLONE_DATABASE_URL=dsn, NOTIFY_SOCKET=sock_path,
            PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        )  # fmt: skip
        self.log_path = tmp / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "cyclone.supervisor", "--config", str(path)],
                env=environ, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.ready_wall = self.wait_ready() if wait else None

    def wait_ready(self) -> float:
        """Block until READY=1; the wall-clock time it came."""
        while not self.sock.recv(4096).startswith(b"READY=1"):
            pass
        return time.time()

    def children(self) -> list[int]:
        text = Path(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children").read_text()
        return [int(p) for p in text.split()]

    def stop(self) -> None:
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self.sock.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

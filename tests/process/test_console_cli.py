"""`cyclone console` as an operator starts it: a server process on loopback that serves the
pages, names no password, and stops cleanly on SIGTERM."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from cli_support import SECRET
from proc_helpers import wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone.testing import TestEnv

SCRIPT = shutil.which("cyclone", path=str(Path(sys.executable).parent)) or "cyclone"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_serves_the_pages_and_stops_on_sigterm(env: TestEnv, tmp_path: Path):
    port = _free_port()
    # A DSN with a password (trust auth ignores it): it must not reach the output.
    params = conninfo_to_dict(env.dsn)
    dsn = make_conninfo(**{**params, "password": SECRET})
    log = tmp_path / "console.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [SCRIPT, "console", "--port", str(port)],
            env={**_env(), "CYCLONE_DATABASE_URL": dsn}, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        line = wait_for(lambda: "console on http://" in log.read_text() and log.read_text(),
                        15, "the console's first line")  # fmt: skip
        assert f"http://127.0.0.1:{port}/" in line and "read-only" in line
        assert SECRET not in line

        def page() -> bytes | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/runs", timeout=5) as r:
                    return r.read()
            except OSError:
                return None

        body = wait_for(page, 15, "the runs page")
        assert b"<h1>Runs</h1>" in body and SECRET.encode() not in body
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log.read_text()
    assert SECRET not in log.read_text()


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("CYCLONE_CONSOLE")}

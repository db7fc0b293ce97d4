"""Driving the `cyclone` console script on a pseudo-terminal, as an operator's terminal would."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

from cyclone.testing import TestEnv


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS")}
    env.pop("CYCLONE_DATABASE_URL", None)
    env.update(extra)
    return env


def read_until(fd: int, pattern: str, seen: bytearray, timeout: float) -> bool:
    """Read the pty into `seen` until `pattern` occurs `count` times or time runs out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                return pattern.encode() in seen
            if not chunk:
                break
            seen += chunk
        if re.search(pattern.encode(), bytes(seen)):
            return True
    return False


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_on_pty(
    cenv: TestEnv, *argv: str, size: tuple[int, int] | None = None, **env: str
) -> tuple[subprocess.Popen[bytes], int]:
    """`cyclone ARGV` on a new pseudo-terminal: 160x60 told by COLUMNS and LINES, or, with
    `size` (lines, columns), that size set on the terminal itself and no variables to help,
    as on a real terminal of that size."""
    primary, secondary = pty.openpty()
    variables = clean_env(TERM="xterm-256color", COLUMNS="160", LINES="60", **env)
    if size is not None:
        fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
        variables.pop("COLUMNS")
        variables.pop("LINES")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cyclone.cli", "--dsn", cenv.dsn, *argv],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=variables,
        close_fds=True,
        # As on an operator's terminal, Ctrl-C interrupts: a test run started in the background
        # of a shell without job control (`... &`) ignores SIGINT, and a child inherits that.
        preexec_fn=_interruptible,
    )
    os.close(secondary)
    return proc, primary


def stop(proc: subprocess.Popen[bytes], primary: int, seen: bytearray) -> int:
    proc.send_signal(signal.SIGINT)
    # Keep reading so the child never blocks on a full terminal buffer while it exits.
    end = time.monotonic() + 15
    while proc.poll() is None and time.monotonic() < end:
        read_until(primary, "$^", seen, 0.2)
    code = proc.wait(timeout=5)
    os.close(primary)
    return code

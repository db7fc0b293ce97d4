"""Setting up a forked child (worker or scanner) and waiting in it without races.

Everything here runs after the fork, in the child: the objects a child runs are built before
the fork and must not touch the process (gunicorn's Worker.__init__ / init_process split).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import select
import signal
import sys

from cyclone.child.channel import ExitCode

PR_SET_PDEATHSIG = 1
# How long a child waits to connect, so that a dead network turns into an error it can act on
# (back off, or stop before its lease expires) rather than a silent stall.
CONNECT_TIMEOUT = 5


class ChildExit(Exception):
    """Leave the child's loop with this exit code (always through os._exit at the top)."""

    def __init__(self, code: ExitCode) -> None:
        super().__init__(code.name)
        self.code = code


def init_process(expected_parent: int) -> None:
    """Own process group, die with the supervisor, fresh randomness."""
    # Its own group, so that a kill of the group reaches what a handler spawned (rq).
    with contextlib.suppress(PermissionError):  # the supervisor already made us a leader
        os.setpgid(0, 0)
    die_with_parent(expected_parent)
    # A forked child shares the parent's random state: reseed, or every worker draws the same
    # retry jitter and scanner stagger.
    random.seed()
    # SIGINT from a terminal goes to the supervisor, which decides; children ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def die_with_parent(expected_parent: int) -> None:
    """SIGKILL us when the supervisor dies; exit at once if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The supervisor may have died between the fork and the prctl above.
    check_parent(expected_parent)


def check_parent(expected_parent: int) -> None:
    if orphaned(expected_parent):
        raise ChildExit(ExitCode.ORPHANED)


def orphaned(expected_parent: int) -> bool:
    return os.getppid() != expected_parent


class Wakeup:
    """A self-pipe the child waits on, fed by signals (set_wakeup_fd).

    Waiting on a pipe instead of a threading.Event keeps signal handlers free of locks: a
    handler that takes a lock the interrupted code holds deadlocks the process.
    """

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)

    def reclaim(self) -> None:
        """Feed the pipe again if code run in the main thread (an asyncio loop's signal
        handling, say) took the wakeup fd for itself."""
        signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)

    def wait(self, timeout: float) -> bytes:
        """Wait until a signal arrives or `timeout` passes; returns the signals' numbers."""
        select.select([self.read_fd], [], [], max(timeout, 0.0))
        got = b""
        try:
            while chunk := os.read(self.read_fd, 4096):
                got += chunk
        except BlockingIOError:
            pass
        return got

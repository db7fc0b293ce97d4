"""The supervisor's door to the operating system: fork, signal, kill a process group, reap.

`ProcessOps` is the only door to the operating system the supervisor's decisions use, so the
decisions run in tests against a fake one. `OsProcessOps` is the real thing: fork with a pipe,
signal, kill a process group, reap with waitpid.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

from cyclone.child import reaper
from cyclone.child.channel import ExitCode, leave
from cyclone.supervisor.children import ExitStatus

log = logging.getLogger(__name__)

# Signals the supervisor handles; a child resets them before it runs any of its own code.
SUPERVISOR_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGCHLD,
    signal.SIGTTIN,
    signal.SIGTTOU,
)
# Exits after which a child has no process of its own left (see OsProcessOps.reap).
CLEAN_EXITS = (ExitCode.OK, ExitCode.RECYCLE)
# Asks a worker to finish its current step, record it, and exit: drain, resize, reload.
RETIRE_SIGNAL = signal.SIGUSR1
# Asks a worker to give up its current step cooperatively (ctx.done is set) before SIGKILL.
STOP_SIGNAL = signal.SIGTERM


ChildMain = Callable[[int], int]


class ProcessOps(Protocol):
    """The OS calls the supervisor's decisions make."""

    def spawn(self, main: ChildMain, *, close_fds: Sequence[int]) -> tuple[int, int]:
        """Fork a child that runs `main(write_fd)`; return (pid, read_fd): the two ends of its
        channel (a socket pair: the supervisor may answer on it)."""

    def signal(self, pid: int, sig: int) -> None:
        """Send `sig` to one process; a process that is gone is not an error."""

    def signal_group(self, pgid: int, sig: int) -> None:
        """Send `sig` to a whole process group; a group that is gone is not an error."""

    def reap(self) -> list[tuple[int, ExitStatus]]:
        """Every child that has exited since the last call."""

    def read(self, fd: int) -> bytes | None:
        """What is waiting in a pipe: b"" at end of file, None when nothing is there yet."""

    def close(self, fd: int) -> None: ...

    def state(self, pid: int) -> tuple[str, int] | None:
        """The process's state letter and CPU ticks (see proc_state); None when gone."""


class OsProcessOps:
    """ProcessOps on the real operating system."""

    def __init__(self) -> None:
        # Descriptors every child must close right after the fork (the supervisor's self-pipe).
        self.private_fds: list[int] = []
        # The children forked on purpose: any other child is an orphan re-parented to us.
        self.spawned: set[int] = set()
        # Children we had before becoming a subreaper; None while we are not one.
        self.spared: set[int] | None = None

    def adopt_orphans(self) -> bool:
        """Become a subreaper: what a worker's handler leaves behind when the worker dies
        comes to us, and `reap` kills it (cyclone/child/reaper.py). False where unsupported."""
        if not reaper.become_subreaper():
            return False
        self.spared = set(reaper.descendants(os.getpid(), reaper.parents(), self.spawned))
        return True

    def spawn(self, main: ChildMain, *, close_fds: Sequence[int]) -> tuple[int, int]:
        # A socket pair, not a pipe: the supervisor answers a worker that asks for its next
        # step on the same channel (supervisor/dispatch.py).
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        read_fd, write_fd = ours.detach(), theirs.detach()
        # Block the supervisor's signals across the fork, so that none is handled in the child
        # by the supervisor's handlers before the child has reset them.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, SUPERVISOR_SIGNALS)
        # Move what exists now out of the collector's reach: a full collection in the child
        # would otherwise write to every inherited object and copy every shared page (the
        # gc.freeze docs; bench/README.md, "Figures behind the code's comments").
        gc.freeze()
        try:
            pid = os.fork()
        except BaseException:
            gc.unfreeze()
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            os.close(read_fd)
            os.close(write_fd)
            raise
        if pid == 0:
            self._child(main, write_fd, [read_fd, *close_fds], old_mask)
        self.spawned.add(pid)
        gc.unfreeze()  # in the supervisor, cycles must stay collectable: it forks for years
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        # Put the child in its own group from this side too: otherwise a kill right after the
        # fork could race the child's own setpgid and miss its group.
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        return pid, read_fd

    def _child(self, main: ChildMain, write_fd: int, close_fds: list[int], mask: object) -> None:
        code = int(ExitCode.CRASHED)
        try:
            signal.set_wakeup_fd(-1)
            for sig in SUPERVISOR_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # type: ignore[arg-type]
            for fd in (*close_fds, *self.private_fds):
                with contextlib.suppress(OSError):
                    os.close(fd)
            code = main(write_fd)
        except BaseException:
            # Through logging, not print_exc: the log's filter escapes what the exception
            # quotes (a name, a payload) and removes the database password (cyclone/sanitize.py).
            log.critical("child %d crashed", os.getpid(), exc_info=True)
        finally:
            leave(code)  # a child never returns into the supervisor's code

    def signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def signal_group(self, pgid: int, sig: int) -> None:
        # PermissionError: the group is gone and its id now names someone else's group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def reap(self) -> list[tuple[int, ExitStatus]]:
        found = []
        orphans = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            exit_status = ExitStatus.decode(status)
            # A child of ours that left cleanly ended its leftovers itself (the worker does,
            # after each step and before it exits); any other exit may have left orphans.
            orphans |= pid not in self.spawned or exit_status.code not in CLEAN_EXITS
            self.spawned.discard(pid)
            found.append((pid, exit_status))
        if orphans and self.spared is not None:
            # A dead worker's orphans (a handler's daemon) are ours now, and so are the
            # orphans of a stray killed last time. None may outlive its step. One read of
            # /proc (about 20 us a process on the host), only after such an exit.
            strays = reaper.kill_strays(self.spawned | self.spared)
            if strays:
                log.warning(
                    "killed %d process(es) left behind by a worker: %s", len(strays),
                    ", ".join(map(str, sorted(strays))), extra={"action": "kill"},
                )  # fmt: skip
        return found

    def read(self, fd: int) -> bytes | None:
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            return None
        except OSError as exc:
            # ECONNRESET: the child died with an answer of ours unread in its socket, which
            # the kernel then resets rather than closes. As gone as a closed pipe.
            if exc.errno in (errno.EBADF, errno.EIO, errno.ECONNRESET):
                return b""
            raise

    def close(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    def state(self, pid: int) -> tuple[str, int] | None:
        return proc_state(pid)


_HAS_PROC = os.path.exists("/proc/self/stat")


def proc_state(pid: int) -> tuple[str, int] | None:
    """What the kernel says of a process: its state letter (R, S, D, T stopped, t traced, Z...)
    and the CPU time it used (utime + stime, in clock ticks); None when it is gone.

    One read of /proc/PID/stat: the supervisor looks at each busy worker once per renewal,
    whatever its handler does, since no thread of the worker has to answer."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        if _HAS_PROC:
            return None
        # No /proc (not Linux): alive or not is all the OS says here, so a stopped worker is
        # not told from a running one, and is renewed until its step's timeout ends it.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "R", 0
    # The command name may hold spaces and parentheses: the fields start after the last ")".
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None

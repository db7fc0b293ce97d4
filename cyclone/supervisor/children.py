"""The supervisor's children: what it knows about each, and the OS calls that fork and kill them.

`ProcessOps` is the only door to the operating system the supervisor's decisions use, so the
decisions run in tests against a fake one. `OsProcessOps` is the real thing: fork with a pipe,
signal, kill a process group, reap with waitpid.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import gc
import logging
import os
import signal
import socket
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cyclone.states import ErrorKind
from cyclone.supervisor import channel
from cyclone.supervisor.channel import ExitCode, LineBuffer, leave

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
# Asks a worker to finish its current step, record it, and exit: drain, resize, reload.
RETIRE_SIGNAL = signal.SIGUSR1
# Asks a worker to give up its current step cooperatively (ctx.done is set) before SIGKILL.
STOP_SIGNAL = signal.SIGTERM


class Role(enum.StrEnum):
    WORKER = "worker"
    SCANNER = "scanner"


class KillReason(enum.StrEnum):
    """Why the supervisor killed a child; the first four are the metric's reasons."""

    TIMEOUT = "timeout"
    CANCEL = "cancel"
    DEADLINE = "deadline"
    SHUTDOWN = "shutdown"
    SILENT = "silent"  # busy but its lease not renewed in time: it may lapse; SIGKILL at once
    LEASE_EXPIRED = "lease_expired"  # a scanner reclaimed the lease: someone else runs it now


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """A decoded waitpid status."""

    code: int | None = None
    signal: int | None = None

    @classmethod
    def decode(cls, status: int) -> ExitStatus:
        # The os.WIF* helpers, never `status >> 8` (gunicorn's bug, fixed in b650332c).
        if os.WIFSIGNALED(status):
            return cls(signal=os.WTERMSIG(status))
        if os.WIFEXITED(status):
            return cls(code=os.WEXITSTATUS(status))
        return cls()

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            return f"killed by {name}"
        if self.code is not None:
            try:
                return f"exited with {self.code} ({ExitCode(self.code).name.lower()})"
            except ValueError:
                return f"exited with {self.code}"
        return "ended"


@dataclass(slots=True)
class HeldLease:
    """A step a worker told us it holds, with its kill times on our monotonic clock."""

    step_id: int
    token: str
    run_id: str
    workflow: str
    node: str
    attempt: int
    leased_at: float
    timeout_at: float | None  # the attempt's own timeout, when it comes before the deadline
    deadline_at: float | None  # the run's deadline
    # When the statement that took or last renewed the lease was sent: the database's lease
    # runs lease_ttl from no earlier than this (None: as the `leased` line arrived).
    renewed_at: float | None = None
    # When the database first said the holder recorded this step while its `done` line had
    # not arrived yet (see Arbiter.check_revocations).
    finished_seen: float | None = None


@dataclass(slots=True)
class KillOrder:
    """A decided kill: SIGTERM sent at `ordered_at`, SIGKILL to the group at `hard_at`."""

    reason: KillReason
    ordered_at: float
    hard_at: float
    step_id: int | None = None
    token: str | None = None
    # What to write for the step once the process is dead; None when the database already
    # knows (the lease was revoked) or there is no step.
    record: ErrorKind | None = None
    error: str = ""
    hard_sent: bool = False
    # A planned stop (shutdown): the step goes back with its attempt not spent.
    release: bool = False


@dataclass(slots=True)
class WorkerHandle:
    """One child process, as the supervisor sees it. Kept in an instance dict by pid."""

    pid: int
    role: Role
    number: int
    generation: int
    fd: int
    spawned_at: float
    last_seen: float
    booted: bool = False
    lease: HeldLease | None = None
    steps: int = 0
    retiring: bool = False
    kill: KillOrder | None = None
    buffer: LineBuffer = field(default_factory=LineBuffer)

    @property
    def busy(self) -> bool:
        return self.lease is not None

    @property
    def label(self) -> str:
        if self.role is Role.SCANNER:
            return f"scanner (pid {self.pid})"
        return f"worker {self.number} (pid {self.pid})"


def lease_trust(lease_ttl: float, heartbeat_interval: float) -> float:
    """How long after its statement was sent a lease is acted on: a heartbeat interval less
    than it lasts in the database. Past that, the worker kills itself and its supervisor
    SIGKILLs it, both before the lease can lapse and be handed to another worker. Config
    validation keeps it at least two heartbeats, so one missed renewal costs nothing."""
    return lease_ttl - heartbeat_interval


# The supervisor's clock and the database's agree only to a few milliseconds; a deadline kill
# waits this much longer so the database agrees that the deadline has passed.
DEADLINE_MARGIN = 0.05


def held_lease(message: channel.Leased, now: float) -> HeldLease:
    """Turn durations measured on the database clock into times on our monotonic clock."""
    timeout_at = deadline_at = None
    if message.deadline_left is not None:
        deadline_at = now + max(message.deadline_left, 0.0) + DEADLINE_MARGIN
    # kill_after is the smaller of timeout and deadline: it is the timeout only when smaller.
    if message.kill_after is not None and (
        message.deadline_left is None or message.kill_after < message.deadline_left
    ):
        timeout_at = now + max(message.kill_after, 0.0)
    return HeldLease(
        step_id=message.step_id, token=message.token, run_id=message.run_id,
        workflow=message.workflow, node=message.node, attempt=message.attempt,
        leased_at=now, timeout_at=timeout_at, deadline_at=deadline_at,
        renewed_at=renewal_time(message.since, now),
    )  # fmt: skip


def renewal_time(since: float | None, now: float) -> float:
    """When a lease's statement was sent, from a message's `since`; never later than `now`
    (a message from a worker cannot come from the future: a fake clock's would)."""
    return now if since is None else min(since, now)


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


class OsProcessOps:
    """ProcessOps on the real operating system."""

    def __init__(self) -> None:
        # Descriptors every child must close right after the fork (the supervisor's self-pipe).
        self.private_fds: list[int] = []

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
            traceback.print_exc()
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
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            found.append((pid, ExitStatus.decode(status)))
        return found

    def read(self, fd: int) -> bytes | None:
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno in (errno.EBADF, errno.EIO):
                return b""
            raise

    def close(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

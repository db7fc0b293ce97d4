"""The supervisor's children: what it knows about each, as plain records.

A `WorkerHandle` per child, the `HeldLease` it reported, the `KillOrder` decided for it, and
the decoded `ExitStatus` it left with. The OS calls that fork and kill them are processes.py.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from cyclone.child import channel
from cyclone.child.channel import ExitCode, LineBuffer
from cyclone.states import ErrorKind

log = logging.getLogger(__name__)


class Role(enum.StrEnum):
    WORKER = "worker"
    SCANNER = "scanner"


class KillReason(enum.StrEnum):
    """Why the supervisor killed a child; the first four are the metric's reasons."""

    TIMEOUT = "timeout"
    CANCEL = "cancel"
    DEADLINE = "deadline"
    SHUTDOWN = "shutdown"
    # Busy, and its lease not renewed in time: it may lapse, so SIGKILL at once. Why it was not
    # renewed tells the three apart (docs/operators.md, "One step, one worker"):
    FROZEN = "frozen"  # the OS said it was stopped (SIGSTOP, a debugger): not vouched for
    LOST_SESSION = "lost_session"  # the supervisor's renewals failed or got no answer
    SILENT = "silent"  # neither: its channel closed, or the supervisor itself was late
    LEASE_EXPIRED = "lease_expired"  # a scanner reclaimed the lease: someone else runs it now
    BAD_MESSAGE = "bad_message"  # it wrote a line that is no message, or flooded its channel


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
    item: int | None = None  # a map item's index
    # Its run's trace id, once tracing looked it up (supervisor/tracing.py): for JSON lines.
    trace_id: str | None = None


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
    # Its slot on the RenewalBoard (child/lease.py): where its lease's renewals are written.
    slot: int | None = None
    # Leases queued in its name and sent to it, not started yet as far as its lines say
    # (supervisor/dispatch.py's `Ready`s): given back once too old or once it is gone.
    queued: list[Any] = field(default_factory=list)
    # What the OS said at the last look (supervisor/liveness.py): the /proc state letter, the
    # CPU time used (clock ticks), and since when (arbiter clock) that time has not moved.
    os_state: str = ""
    cpu: int = -1
    cpu_still_since: float = 0.0
    # Its channel reached end of file: it is leaving (or broken), nothing vouches for it.
    eof: bool = False
    # Killed for a bad message or a flood: whatever else it writes is not read.
    deaf: bool = False
    # Lines read in the current second (see Arbiter.read_channel), and when it began.
    lines: int = 0
    lines_since: float = 0.0
    # The code its last `exit` line announced: an exit status that matches it is the child's
    # own decision; one that does not, while a handler ran, is the handler's (see exit_by).
    exit_said: int | None = None

    @property
    def busy(self) -> bool:
        return self.lease is not None

    @property
    def label(self) -> str:
        if self.role is Role.SCANNER:
            return f"scanner (pid {self.pid})"
        return f"worker {self.number} (pid {self.pid})"


class ExitBy(enum.StrEnum):
    """Whose decision ended a child (`exit_by`)."""

    CHILD = "child"  # its own exit code, announced by an `exit` line (or idle: nothing else ran)
    HANDLER = "handler"  # an exit code nobody announced while a handler ran: os._exit in it
    SIGNAL = "signal"  # killed by a signal (ours, the OOM killer's, a segfault)


def exit_by(handle: WorkerHandle, status: ExitStatus) -> ExitBy:
    """Who ended the child. A worker announces each exit of its own (`channel.leave`); only
    while it runs a step does other code run in it, so an unannounced exit code then is the
    handler's. Idle, an unannounced code is still taken as the child's: the line can be lost
    (its lock held by a thread stuck on a full socket)."""
    if status.code is None:
        return ExitBy.SIGNAL
    if handle.lease is not None and handle.exit_said != status.code:
        return ExitBy.HANDLER
    return ExitBy.CHILD


def describe_exit(handle: WorkerHandle, status: ExitStatus) -> str:
    """What ended a worker mid-step, as its step's error text."""
    if exit_by(handle, status) is ExitBy.HANDLER:
        return f"handler called os._exit({status.code}) (or ended its process in a like way)"
    return f"worker process {status.describe()}"


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
        renewed_at=renewal_time(message.since, now), item=message.item,
    )  # fmt: skip


def renewal_time(since: float | None, now: float) -> float:
    """When a lease's statement was sent, from a message's `since`; never later than `now`
    (a message from a worker cannot come from the future: a fake clock's would)."""
    return now if since is None else min(since, now)

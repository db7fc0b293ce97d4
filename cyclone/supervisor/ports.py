"""What the arbiter needs from the world, as protocols: the real loop and the tests fill them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from cyclone.child.channel import Done, Scanned
from cyclone.states import ErrorKind
from cyclone.supervisor.children import ExitStatus, HeldLease, KillReason, WorkerHandle
from cyclone.supervisor.processes import ChildMain


@dataclass(frozen=True, slots=True)
class ArbiterConfig:
    workers: int
    kill_grace: float
    shutdown_timeout: float
    lease_ttl: float
    poll_interval: float
    scanner: bool
    heartbeat_interval: float = 0.0  # a silent worker dies this long before its lease lapses


class Store(Protocol):
    """The database calls the supervisor makes, each on a short-lived or its own connection."""

    def revoked(self, held: Mapping[int, str]) -> dict[int, str | None]: ...

    def fail_step(self, step_id: int, token: str, kind: ErrorKind, error: str) -> bool: ...

    def sweep_deadlines(self) -> int: ...

    def release_step(self, step_id: int, token: str) -> bool: ...


class ChildFactory(Protocol):
    """Builds a child's object before the fork; the returned main runs after it. A worker
    reads its lease's renewals from `slot` of the RenewalBoard (child/lease.py)."""

    def worker_main(self, number: int, slot: int | None = None) -> ChildMain: ...

    def scanner_main(self) -> ChildMain: ...


class Renewals(Protocol):
    """The session that renews the workers' leases (supervisor/renewal.py). `send` does not
    wait for the answer: the loop hands it to `Arbiter.renewed` (or `renewal_failed`)."""

    @property
    def in_flight(self) -> bool: ...

    def send(self, leases: list[tuple[int, str]]) -> None:
        """Send one statement renewing every (step id, token); raises psycopg.Error when it
        cannot be sent (no session)."""

    def close(self) -> None:
        """Drop the session (a statement that never answered goes with it)."""


class Watcher(Protocol):
    """The loop's selector: a channel must be unwatched before its descriptor is closed."""

    def watch(self, fd: int) -> None: ...

    def unwatch(self, fd: int) -> None: ...


class Events(Protocol):
    """What the arbiter reports as it happens (the metrics)."""

    def leased(self, lease: HeldLease) -> None: ...

    def finished(self, lease: HeldLease, outcome: str, duration: float | None) -> None: ...

    def killed(self, reason: KillReason) -> None: ...

    def exited(self, handle: WorkerHandle, status: ExitStatus) -> None: ...

    def scanned(self, report: Scanned) -> None: ...

    def runs_failed(self, reason: str, count: int) -> None: ...


class Traces(Protocol):
    """Each attempt a span (supervisor/tracing.py), when tracing is on: None otherwise, so a
    step costs nothing more without it. Calls only enqueue; kills end their attempt's span."""

    def started(self, lease: HeldLease) -> None: ...

    def reported(self, lease: HeldLease, done: Done) -> None: ...

    def killing(self, lease: HeldLease, reason: KillReason, error: str, hard: bool) -> None: ...

    def ended(self, lease: HeldLease, outcome: str, error: str, reason: str | None) -> None: ...

    def close(self) -> None: ...


class NullEvents:
    def leased(self, lease: HeldLease) -> None:
        pass

    def finished(self, lease: HeldLease, outcome: str, duration: float | None) -> None:
        pass

    def killed(self, reason: KillReason) -> None:
        pass

    def exited(self, handle: WorkerHandle, status: ExitStatus) -> None:
        pass

    def scanned(self, report: Scanned) -> None:
        pass

    def runs_failed(self, reason: str, count: int) -> None:
        pass


class NullWatcher:
    def watch(self, fd: int) -> None:
        pass

    def unwatch(self, fd: int) -> None:
        pass


Reloader = Callable[[], tuple[ArbiterConfig, ChildFactory]]

"""The supervisor's few database calls, and the LISTEN connection that wakes it on revocations
and on steps made ready while it waits for work (migration 22).

Its calls here (a revocation check when notified, and every poll interval while a worker is
busy, ten times less often with notifications working; a killed worker's outcome; a deadline
sweep before a kill) share one kept connection: opening one for each started a backend each
time, every second with notifications unavailable (see bench/README.md, "Figures behind the
code's comments").
The long-lived LISTEN connection does nothing else, so every notification reaches the loop;
presence keeps one of its own (presence.py). Children inherit the sockets of all three but
never touch them: psycopg only finishes a libpq connection in the process that opened it,
and a child leaves through os._exit, so the supervisor's sessions are never closed from a
child.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import psycopg

from cyclone import engine
from cyclone.child.session import connect_briefly
from cyclone.sql import QUERIES
from cyclone.states import WAKE_SETTLE, ErrorKind

log = logging.getLogger(__name__)
T = TypeVar("T")

CHANNEL = "cyclone_revoked"
READY_CHANNEL = "cyclone_ready"
# How long the start-up probe waits for its own notification before settling on polling.
PROBE_TIMEOUT = 1.0
# LISTEN is not in cyclone/sql because it takes no parameters and changes no data.
LISTEN = "LISTEN cyclone_revoked; LISTEN cyclone_ready"
UNLISTEN = "UNLISTEN *"
# A revocation check runs at most this often on notifications: any session may NOTIFY the
# channel, and a flood of them made one supervisor run 7,000 checks in 4 s. A notification
# that arrives sooner is kept and answered when the interval is over, so none is lost.
NOTIFY_EVERY = 0.1
# At most this many notifications are read at one wake-up: a flood must not keep the loop
# reading (the rest are read at the next, and one is as good as many).
NOTIFY_READ = 1000


class Listener:
    """The LISTEN connection: wakes the loop on revocations, once a probe showed they arrive."""

    def __init__(self, dsn: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.dsn = dsn
        self.clock = clock
        # A notification read and not yet answered by a check, and when the next may be.
        self.pending = False
        self.next_at = 0.0
        # A step was made ready since the dispatcher last looked (not debounced: one wake-up
        # answers any number of them, and each is sent only while a supervisor waits).
        self.ready = False
        self.conn: psycopg.Connection[Any] | None = None
        self.working = False
        self.probed: bool | None = None
        self.gave_up = False
        self.fd = -1

    def open(self) -> bool:
        """Connect and LISTEN; returns whether notifications were seen to arrive."""
        self.conn = connect_briefly(self.dsn)
        # Kept: once the connection is lost, psycopg no longer tells its descriptor, and the
        # loop still has to unregister it from the selector.
        self.fd = self.conn.fileno()
        self.conn.execute(LISTEN)
        # Probe once: a reconnect goes through the same path as the first connection did.
        if self.probed is None:
            self.probed = self.probe()
        self.working = self.probed
        if not self.working:
            self.give_up()
            return False
        log.info("revocations: LISTEN/NOTIFY", extra={"action": "listen"})
        return True

    def give_up(self) -> None:
        """Poll for good: said once, and the connection is closed rather than retried.

        Behind a transaction-mode pooler the LISTEN ran on whichever server connection served
        that statement and stays there, so the UNLISTEN may miss it (that session then drops
        the notifications it gets). Retrying would LISTEN on yet another one.
        """
        log.warning(
            "revocations: polling every poll interval; notifications do not arrive here "
            "(a transaction-mode pooler, or a slow server): LISTEN is not retried",
            extra={"action": "listen"},
        )
        assert self.conn is not None
        with contextlib.suppress(psycopg.Error):
            self.conn.execute(UNLISTEN)
        self.close()
        self.gave_up = True

    def probe(self) -> bool:
        # Sent from another session, as a scanner's would be: behind PgBouncer in transaction
        # mode LISTEN succeeds but nothing is ever delivered, and only a probe tells.
        with connect_briefly(self.dsn) as other:
            other.execute(QUERIES["revoked_notify"])
        assert self.conn is not None
        return any(True for _ in self.conn.notifies(timeout=PROBE_TIMEOUT, stop_after=1))

    def fileno(self) -> int:
        assert self.conn is not None
        return self.fd

    def drain(self) -> bool:
        """Read what arrived on the socket; returns whether a revocation check is due now (a
        notification came, and none was answered in the last NOTIFY_EVERY)."""
        if self.conn is None:
            return False
        # timeout=0 reads what the socket holds without waiting for more.
        for note in self.conn.notifies(timeout=0, stop_after=NOTIFY_READ):
            if note.channel == READY_CHANNEL:
                self.ready = True
            else:
                self.pending = True
        return self.due()

    def take_ready(self) -> bool:
        """Whether a step was made ready since the last call (then it is taken)."""
        ready, self.ready = self.ready, False
        return ready

    def due(self) -> bool:
        """Whether a notification kept back is to be answered now (then it is taken)."""
        now = self.clock()
        if not self.pending or now < self.next_at:
            return False
        self.pending, self.next_at = False, now + NOTIFY_EVERY
        return True

    def wake_at(self) -> float | None:
        """When a notification kept back is due (the loop wakes for it), or None."""
        return self.next_at if self.pending else None

    @property
    def healthy(self) -> bool:
        """Nothing to repair: connected, or given up on for good."""
        return self.gave_up or (
            self.conn is not None and not self.conn.closed and not self.conn.broken
        )

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.working = False


class KeptSession:
    """One connection, opened on first use and again once an error took it down."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]]) -> None:
        self.connect = connect
        self.conn: psycopg.Connection[Any] | None = None

    @property
    def alive(self) -> bool:
        return self.conn is not None and not self.conn.closed and not self.conn.broken

    def get(self) -> psycopg.Connection[Any]:
        if not self.alive:
            self.close()
            self.conn = self.connect()
        assert self.conn is not None
        return self.conn

    def drop_if_lost(self) -> bool:
        """After an error: whether it took the session down (which is then dropped)."""
        if self.alive:
            return False
        self.close()
        return True

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class DatabaseStore:
    """The arbiter's Store on a real database, through one kept connection.

    A kept connection that the server ended while it idled (a restart, a pooler's or an idle
    timeout) fails at its next use; that call is then made once more on a new connection, so
    that a kill's outcome is not left to lease expiry because of it. A write whose commit was
    lost with its connection finds its fence gone the second time and changes nothing.
    """

    def __init__(
        self,
        dsn: str,
        batch_size: int,
        connect: Callable[[], psycopg.Connection[Any]] | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.session = KeptSession(connect or (lambda: connect_briefly(dsn)))

    def revoked(self, held: Mapping[int, str]) -> dict[int, str | None]:
        # Not on the LISTEN connection: it only listens, so every notification wakes the loop.
        return self._call(lambda conn: engine.revoked_leases(conn, held))

    def fail_step(self, step_id: int, token: str, kind: ErrorKind, error: str) -> bool:
        return self._call(
            lambda conn: engine.fail_step(conn, step_id, token, kind=kind, error=error)
        )

    def sweep_deadlines(self) -> int:
        return self._call(lambda conn: engine.sweep_deadlines(conn, batch_size=self.batch_size))

    def release_step(self, step_id: int, token: str) -> bool:
        return self._call(lambda conn: engine.release_step(conn, step_id, token))

    def arm_wake(self) -> None:
        """Say that this VM waits for ready steps (migration 22): the next notifies."""
        self._call(lambda conn: conn.execute(QUERIES["wake_arm"], {"most": WAKE_SETTLE}))

    def close(self) -> None:
        self.session.close()

    def _call(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        kept = self.session.alive
        try:
            return fn(self.session.get())
        except psycopg.Error:
            # A statement's own failure (a timeout, say) leaves the session as it was; a new
            # session that died at once says the database itself is in trouble.
            if not self.session.drop_if_lost() or not kept:
                raise
        try:
            return fn(self.session.get())  # the kept session had died while it idled
        except psycopg.Error:
            self.session.drop_if_lost()
            raise

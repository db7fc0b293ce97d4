"""The lease keeper: the thread beside the worker's main thread, which runs the handler.

While a step runs, the keeper renews its lease every `heartbeat_interval` and relays a stop
(SIGTERM) to the handler's `ctx.done`. It is the only reader of the signal self-pipe, so it
sees a signal the moment it arrives, even while the handler is stuck in C code that never
lets the main thread's Python signal handler run.

It also keeps the lease's timeline (docs/operators.md, "One step, one worker"): a lease is
acted on for `lease_trust` after the statement that took or renewed it was sent, a heartbeat
interval less than the database keeps it. Once that passes without a renewal the keeper ends
the process, handler and all, before anyone else can lease the step. Signals are blocked in
this thread, so the kernel delivers them to the main thread: a handler asleep there is woken
by a SIGCONT and its Python signal handler (the worker's) ends the process before the
handler's next line runs.

Between steps it does nothing: the main thread only swaps what is held under a lock, and the
keeper, asleep until the held lease's next renewal is due, finds the new one when it wakes.
A no-op step costs no thread switch at all, where handing each step to a pool thread and back
would cost two (see bench/README.md, "Figures behind the code's comments").
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from cyclone import engine
from cyclone.child import channel
from cyclone.child.channel import ExitCode, leave
from cyclone.child.lease import lease_trust
from cyclone.child.process import Wakeup, orphaned
from cyclone.context import CancelEvent
from cyclone.engine.steps import Lease

log = logging.getLogger(__name__)


# Signals for the main thread only (see the module's docstring).
MAIN_THREAD_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGCONT}


@dataclass(slots=True)
class Held:
    lease: Lease
    done: CancelEvent
    renewed_at: float  # monotonic, like next_at: when the last renewal's statement was sent
    next_at: float  # the next renewal (sooner after one that failed)


def may_go_on(lease: Lease, renewed_at: float, ttl: float, beat: float, exc: Exception) -> bool:
    """After a failed renewal or write: whether the lease can still be trusted for a while.

    The worker stops acting on a lease a heartbeat before it could expire unrenewed (the
    moment its supervisor would kill it): never act on stale authority.
    """
    left = renewed_at + ttl - time.monotonic()
    log.warning("step %d: cannot renew the lease (%.1fs left): %s", lease.step_id, left, exc)
    return left > ttl - lease_trust(ttl, beat)


class LeaseKeeper:
    def __init__(
        self,
        *,
        db: Callable[[], psycopg.Connection[Any]],
        channel: channel.Channel,
        wakeup: Wakeup,
        lease_ttl: float,
        heartbeat_interval: float,
        on_signal: Callable[[int], None],
        stopping: Callable[[], bool],
        parent: int,
    ) -> None:
        self.db = db
        self.channel = channel
        self.wakeup = wakeup
        self.lease_ttl = lease_ttl
        self.beat = heartbeat_interval
        self.on_signal = on_signal
        self.stopping = stopping
        self.parent = parent
        self._lock = threading.Lock()
        self._held: Held | None = None
        self.trust = lease_trust(lease_ttl, heartbeat_interval)
        # Until when the held lease may be acted on (monotonic), None between steps. A plain
        # attribute, read without the lock: a signal handler reads it (see `lapsed`).
        self.trusted_until: float | None = None

    def start(self) -> None:
        threading.Thread(target=self._main, name="lease-keeper", daemon=True).start()

    def hold(self, lease: Lease, done: CancelEvent, leased_at: float) -> None:
        """The main thread is about to run this lease's handler."""
        with self._lock:
            self._held = Held(lease, done, leased_at, leased_at + self.beat)
            self.trusted_until = leased_at + self.trust
            if self.stopping():
                done.set()  # the stop came while the lease was being taken

    def release(self) -> float:
        """The handler returned: stop renewing. Returns when the lease was last renewed.

        Waits for a renewal in flight, so that the main thread's next write on the shared
        connection never races one of ours for the same lease.
        """
        with self._lock:
            held, self._held = self._held, None
            self.trusted_until = None
        assert held is not None
        return held.renewed_at

    def lapsed(self) -> bool:
        """Whether a lease is held that may have lapsed by now (safe in a signal handler)."""
        until = self.trusted_until
        return until is not None and time.monotonic() >= until

    # --- the thread ---------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)
            while True:
                with self._lock:
                    held = self._held
                    due = None if held is None else min(held.next_at, held.renewed_at + self.trust)
                # Idle, it still wakes once a heartbeat interval: a step held meanwhile is due
                # no sooner than that.
                timeout = self.beat if due is None else due - time.monotonic()
                for signum in self.wakeup.wait(timeout):
                    self.on_signal(signum)
                if orphaned(self.parent):
                    leave(ExitCode.ORPHANED)
                with self._lock:
                    if self._held is not None:
                        self._check_trust(self._held)
                        self._tend(self._held)
        except ConnectionError:  # the supervisor is gone (its channel closed under a Beat)
            leave(ExitCode.ORPHANED)
        except BaseException:  # a dead keeper would let leases lapse silently
            traceback.print_exc()
            leave(ExitCode.CRASHED)

    def _check_trust(self, held: Held) -> None:
        if time.monotonic() < held.renewed_at + self.trust:
            return
        # Frozen, starved, or its renewals stuck: the lease may lapse any moment now, and the
        # step go to another worker. Stop running its handler before that can happen.
        log.error("step %d: lease not renewed in time; stopping its handler", held.lease.step_id)
        held.done.set()
        leave(ExitCode.LEASE_LOST)

    def _tend(self, held: Held) -> None:
        if self.stopping() and not held.done.is_set():
            held.done.set()  # a cooperative handler stops; the supervisor kills the rest
        if time.monotonic() < held.next_at:
            return
        # The lease's new term runs from no earlier than the statement is sent.
        sent = time.monotonic()
        try:
            renewed = engine.heartbeat(
                self.db(), held.lease.step_id, held.lease.token, lease_ttl=self.lease_ttl
            )
        except psycopg.OperationalError as exc:
            if not may_go_on(held.lease, held.renewed_at, self.lease_ttl, self.beat, exc):
                held.done.set()
                leave(ExitCode.LEASE_LOST)
            # Try again a little later, not in a tight loop against a dead server.
            held.next_at = time.monotonic() + min(1.0, self.beat / 2)
            return
        if not renewed:
            # Revoked (cancel, deadline) or reclaimed: whatever the handler returns is void.
            log.warning("step %d: lease lost while running", held.lease.step_id)
            held.done.set()
            leave(ExitCode.LEASE_LOST)
        held.renewed_at = sent
        held.next_at = sent + self.beat
        self.trusted_until = sent + self.trust
        self.channel.send(channel.Beat(step_id=held.lease.step_id, since=sent))

"""The lease keeper: the thread beside the worker's main thread, which runs the handler.

While a step runs, the keeper relays a stop (SIGTERM) to the handler's `ctx.done` and keeps the
lease's timeline. It is the only reader of the signal self-pipe, so it sees a signal the moment
it arrives, even while the handler is stuck in C code that never lets the main thread's Python
signal handler run.

It does not renew the lease: the supervisor does, for every worker it judges alive, in one
statement for all of them (supervisor/renewal.py), and writes when it sent each renewal on the
`RenewalBoard` this worker shares with it (child/lease.py). A thread of the worker renewing
its own lease needed the GIL to run, and a handler inside one long C call that holds it (a big
`sorted`, `json.dumps` of a large object, a backtracking regex) starved it: its lease was not
renewed and the supervisor killed a healthy handler (issue 29).

The timeline (docs/operators.md, "One step, one worker"): a lease is acted on for
`lease_trust` after the statement that took or last renewed it was sent, a heartbeat interval
less than the database keeps it. Once that passes with no renewal on the board (the supervisor
frozen, stuck, or unable to reach the database) the keeper ends the process, handler and all,
before anyone else can lease the step; the supervisor, when it can act, SIGKILLs the worker at
the same moment. Signals are blocked in this thread, so the kernel delivers them to the main
thread: a handler asleep there is woken by a SIGCONT and its Python signal handler (the
worker's) ends the process before the handler's next line runs.

Between steps it does nothing: the main thread only swaps what is held under a lock, and the
keeper, asleep until the held lease's trust runs out, finds the new one when it wakes.
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

from cyclone.child.channel import ExitCode, leave
from cyclone.child.lease import RenewalBoard, lease_trust
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
    leased_at: float  # monotonic: when the statement that took the lease was sent


def may_go_on(lease: Lease, renewed_at: float, ttl: float, beat: float, exc: Exception) -> bool:
    """After a failed write: whether the lease can still be trusted for a while.

    The worker stops acting on a lease a heartbeat before it could expire unrenewed (the
    moment its supervisor would kill it): never act on stale authority.
    """
    left = renewed_at + ttl - time.monotonic()
    return left > ttl - lease_trust(ttl, beat)


class LeaseKeeper:
    def __init__(
        self,
        *,
        wakeup: Wakeup,
        lease_ttl: float,
        heartbeat_interval: float,
        on_signal: Callable[[int], None],
        stopping: Callable[[], bool],
        parent: int,
        board: RenewalBoard | None = None,
        slot: int | None = None,
    ) -> None:
        self.wakeup = wakeup
        self.beat = heartbeat_interval
        self.on_signal = on_signal
        self.stopping = stopping
        self.parent = parent
        self.board = board
        self.slot = slot
        self._lock = threading.Lock()
        # A plain attribute, swapped under the lock but read without it: a signal handler
        # reads it (see `lapsed`).
        self._held: Held | None = None
        self.trust = lease_trust(lease_ttl, heartbeat_interval)

    def start(self) -> None:
        threading.Thread(target=self._main, name="lease-keeper", daemon=True).start()

    def hold(self, lease: Lease, done: CancelEvent, leased_at: float) -> None:
        """The main thread is about to run this lease's handler."""
        with self._lock:
            self._held = Held(lease, done, leased_at)
            if self.stopping():
                done.set()  # the stop came while the lease was being taken

    def current(self) -> Lease | None:
        """The lease whose handler runs now, if any (read by the JSON logs' StepFields)."""
        held = self._held
        return None if held is None else held.lease

    def release(self) -> float:
        """The handler returned: returns when the lease was last renewed (or taken)."""
        with self._lock:
            held, self._held = self._held, None
        assert held is not None
        return self.renewed_at(held.lease, held.leased_at)

    def renewed_at(self, lease: Lease, leased_at: float) -> float:
        """When the statement that took or last renewed this lease was sent (monotonic)."""
        if self.board is None:
            return leased_at
        renewed = self.board.renewed(self.slot, lease.step_id)
        return leased_at if renewed is None else max(leased_at, renewed)

    def lapsed(self) -> bool:
        """Whether a lease is held that may have lapsed by now (safe in a signal handler)."""
        held = self._held
        return held is not None and time.monotonic() >= self._until(held)

    def _until(self, held: Held) -> float:
        return self.renewed_at(held.lease, held.leased_at) + self.trust

    # --- the thread ---------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)
            while True:
                with self._lock:
                    held = self._held
                    due = None if held is None else self._until(held)
                # Idle, it still wakes once a heartbeat interval: a step held meanwhile is due
                # no sooner than that, and the supervisor's presence is checked that often.
                timeout = self.beat if due is None else min(due - time.monotonic(), self.beat)
                for signum in self.wakeup.wait(timeout):
                    self.on_signal(signum)
                if orphaned(self.parent):
                    leave(ExitCode.ORPHANED)
                with self._lock:
                    if self._held is not None:
                        self._check_trust(self._held)
                        self._tend(self._held)
        except BaseException:  # a dead keeper would let leases lapse silently
            traceback.print_exc()
            leave(ExitCode.CRASHED)

    def _check_trust(self, held: Held) -> None:
        if time.monotonic() < self._until(held):
            return
        # Frozen, or its supervisor stopped renewing (frozen, stuck, its database session
        # lost): the lease may lapse any moment now, and the step go to another worker. Stop
        # running its handler before that can happen.
        log.error("step %d: lease not renewed in time; stopping its handler", held.lease.step_id)
        held.done.set()
        leave(ExitCode.LEASE_LOST)

    def _tend(self, held: Held) -> None:
        if self.stopping() and not held.done.is_set():
            held.done.set()  # a cooperative handler stops; the supervisor kills the rest

"""The worker process: lease one step, run it (its supervisor renews the lease), record it."""

from __future__ import annotations

import _signal
import logging
import os
import signal
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from cyclone import engine, runner
from cyclone.child import channel, environ, limits, reaper
from cyclone.child.channel import Channel, ExitCode
from cyclone.child.lease import RenewalBoard
from cyclone.child.process import (
    CONNECT_TIMEOUT,
    ChildExit,
    Wakeup,
    check_parent,
    init_process,
)
from cyclone.child.proctitle import set_title, worker_name, worker_title
from cyclone.context import CancelEvent, Effects
from cyclone.db import HOT_PLANS, connect, with_options
from cyclone.engine.dispatch import aged, finished_json, lease_of
from cyclone.engine.steps import Lease
from cyclone.engine.versions import Served
from cyclone.logs import StepFields, json_handlers
from cyclone.outage import OutageLog
from cyclone.sql import QUERIES
from cyclone.states import NodeKind
from cyclone.tracecontext import trace_id_of
from cyclone.worker.keeper import LeaseKeeper, may_go_on
from cyclone.workflow import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    number: int
    dsn: str
    lease_ttl: float
    heartbeat_interval: float
    poll_interval: float
    max_steps: int  # 0: never recycle
    # Ask the supervisor for each step, and have it record finished tasks (dispatch.py).
    dispatch: bool = False
    max_memory: int | None = None  # bytes: RLIMIT_DATA, set after the fork (child/limits.py)
    # What it leases on its own (None: every workflow of its registry): the supervisor keeps
    # the queues' caps, so their workflows are leased only through it.
    own_workflows: tuple[str, ...] | None = None


# Told to lease on its own (the supervisor's session failed), a worker does so this long
# before it asks the supervisor again.
OWN_FOR = 5.0
# Runs whose trace id a worker keeps for its JSON log lines.
TRACE_IDS_KEPT = 64
# How long a wait for the supervisor's answer lasts before the worker checks it is still there.
ANSWER_POLL = 1.0
# The same, parked (waiting for work, for as long as none comes): how soon a stop or retire
# signal from elsewhere than its supervisor is acted on (the supervisor answers its own first).
PARKED_POLL = 0.2


class Worker:
    """Built in the supervisor before the fork; `run` is the child's main after it."""

    def __init__(
        self,
        options: WorkerOptions,
        registry: Registry,
        parent: int,
        board: RenewalBoard | None = None,
        slot: int | None = None,
    ) -> None:
        self.options = options
        # Where the supervisor says when it renewed this worker's lease (child/lease.py); a
        # worker without one (forked alone, in tests) trusts a lease for one term only.
        self.board = board
        self.slot = slot
        self.registry = registry
        self.parent = parent
        self.stop_requested = False  # SIGTERM: leave the current step, record nothing
        self.retire_requested = False  # SIGUSR1: finish the current step, then leave
        self.steps = 0
        self.idle_reported = False
        self.conn: psycopg.Connection[Any] | None = None
        self.effects_conn: psycopg.Connection[Any] | None = None  # ctx.transaction()'s
        self.unsent: channel.Done | None = None  # sent with the next lease's line
        # When the statement that took the lease in hand was sent (monotonic): its term in the
        # database starts no earlier.
        self.lease_sent = 0.0
        self.name = ""
        # The names this worker leases for itself, on every lease it takes on its own.
        self.workflows = (
            tuple(registry) if options.own_workflows is None else options.own_workflows
        )
        # The graph versions its code can run (engine/versions.py), looked up again now and
        # then: what it leases on its own is only ever steps of those.
        self.served = Served(registry.only(lambda wf: wf.name in self.workflows))
        self.own_until = 0.0  # leasing on its own until then, though dispatch is on
        self.given = False  # the held lease came from the supervisor, which reported it
        # Leases the supervisor took in this worker's name (supervisor/dispatch.py), started
        # in turn as the steps before them end, each while still young (`Queued.until`).
        self.queue: deque[channel.Queued] = deque()
        # Set by the keeper when a signal arrives: wakes the idle main thread.
        self.nudge = threading.Event()
        # Trace ids of recent runs, for JSON log lines (see trace_of).
        self.trace_ids: OrderedDict[str, str | None] = OrderedDict()
        self.trace_lock = threading.Lock()
        self.trace_conn: psycopg.Connection[Any] | None = None
        self.record_outage: OutageLog | None = None  # recording a step failed (check_trust)

    # --- process ------------------------------------------------------------------------------

    def run(self, fd: int) -> int:
        self.channel = Channel(fd)
        try:
            init_process(self.parent)
            # What a handler daemonises stays below us, and ends with its step.
            reaper.become_subreaper()
            limits.limit_memory(self.options.max_memory)
            # Before any handler runs: what it starts must not inherit the password.
            self.options = replace(self.options, dsn=environ.scrub_environment(self.options.dsn))
            self.wakeup = Wakeup()
            self.install_signals()
            self.name = worker_name(
                socket.gethostname(), self.parent, self.options.number, os.getpid()
            )
            set_title(worker_title(self.options.number))
            try:
                self.conn = self.connect()
            except psycopg.Error as exc:
                log.error("worker %d cannot connect: %s", self.options.number, exc)
                return ExitCode.BOOT_ERROR
            self.keeper = LeaseKeeper(
                wakeup=self.wakeup, lease_ttl=self.options.lease_ttl,
                heartbeat_interval=self.options.heartbeat_interval,
                on_signal=self._on_signal_seen, stopping=lambda: self.stop_requested,
                parent=self.parent, board=self.board, slot=self.slot,
            )  # fmt: skip
            self.keeper.start()
            for handler in json_handlers():  # JSON logs name the step of every line
                handler.addFilter(StepFields(self.keeper.current, self.trace_of))
            self.channel.send(channel.Ready())
            code = self.loop()
            # Whatever a handler's thread started since: the supervisor counts on a clean
            # exit leaving nothing behind (it looks for orphans only after other exits).
            reaper.end_leftovers()
            return code
        except ChildExit as exc:
            return exc.code
        except ConnectionError:  # broken pipe or reset: the supervisor is gone
            return ExitCode.ORPHANED

    def install_signals(self) -> None:
        """Ours again, if the handler the main thread just ran took them (an asyncio loop's
        add_signal_handler does, and resets them when it closes): cheap when nothing changed.

        Read through `_signal`, the C module under `signal`: `signal.getsignal` first tries
        to make a handler function into an enum member, and raises and catches an exception
        doing so, twice a step (see bench/README.md, "Figures behind the code's comments").
        """
        if _signal.getsignal(signal.SIGTERM) != self._on_stop:
            signal.signal(signal.SIGTERM, self._on_stop)
        if _signal.getsignal(signal.SIGUSR1) != self._on_retire:
            signal.signal(signal.SIGUSR1, self._on_retire)
        if _signal.getsignal(signal.SIGCONT) != self._on_continue:
            signal.signal(signal.SIGCONT, self._on_continue)

    def _on_stop(self, signum: int, frame: object) -> None:
        self.stop_requested = True  # only record: the loop acts on it

    def _on_retire(self, signum: int, frame: object) -> None:
        self.retire_requested = True

    def _on_continue(self, signum: int, frame: object) -> None:
        # Resumed after a stop (SIGSTOP, a debugger, a frozen container). Runs in the main
        # thread between two bytecodes of the handler, or at once if it slept: when the lease
        # may have lapsed, the step may be running elsewhere already, so not one more line of
        # the handler runs. No logging here (its locks may be held by the code interrupted).
        keeper = getattr(self, "keeper", None)  # None before it started: no lease held yet
        if keeper is not None and keeper.lapsed():
            os.write(2, b"cyclone worker: resumed past its lease; exiting\n")
            self.channel.say_exit(ExitCode.LEASE_LOST, wait=0.1)  # not a handler's exit
            os._exit(ExitCode.LEASE_LOST)

    def _on_signal_seen(self, signum: int) -> None:
        # In the keeper thread, maybe before the main thread's handler above has run (it runs
        # only between bytecodes): record here too, then wake the main thread if it idles.
        if signum == signal.SIGTERM:
            self.stop_requested = True
        elif signum == signal.SIGUSR1:
            self.retire_requested = True
        self.nudge.set()

    def trace_of(self, lease: Lease) -> str | None:
        """The trace id of the lease's run, for JSON log lines: read once a run, on a session
        of its own (a record may be logged while the worker's session is mid-statement), and
        skipped (None) while another thread reads it or the database does not answer."""
        cached = self.trace_ids.get(lease.run_id, False)
        if cached is not False:
            return cached  # type: ignore[return-value]
        if not self.trace_lock.acquire(blocking=False):
            return None
        try:
            if self.trace_conn is None or self.trace_conn.closed or self.trace_conn.broken:
                self.trace_conn = self.connect("cyclone-logs")
            row = self.trace_conn.execute(
                QUERIES["run_trace_parents"], {"run_ids": [lease.run_id]}
            ).fetchone()
            found = trace_id_of(row["trace_parent"] if row else None)
        except psycopg.Error:
            return None
        finally:
            self.trace_lock.release()
        self.trace_ids[lease.run_id] = found
        while len(self.trace_ids) > TRACE_IDS_KEPT:
            self.trace_ids.popitem(last=False)
        return found

    def connect(
        self, name: str = "cyclone-worker", *, hot: bool = True
    ) -> psycopg.Connection[Any]:
        """A session of this worker; `hot`: it runs Cyclone's statements only, planned as the
        hot sessions plan (db.HOT_PLANS; a handler's own SQL, on the effects session, keeps
        the server's planning)."""
        keepalive = max(int(self.options.heartbeat_interval), 1)
        # A transaction left open (a handler's, by a worker frozen mid-step) holds its locks
        # no longer than a lease: its session is ended and the transaction rolled back.
        options = f"-c idle_in_transaction_session_timeout={int(self.options.lease_ttl * 1000)}"
        if hot:
            options += f" {HOT_PLANS}"
        return connect(
            with_options(self.options.dsn, options), f"{name}-{self.options.number}",
            connect_timeout=CONNECT_TIMEOUT, keepalives=1,
            keepalives_idle=keepalive, keepalives_interval=keepalive, keepalives_count=3,
            tcp_user_timeout=int(self.options.lease_ttl * 1000 / 2),
        )  # fmt: skip

    # --- the loop -----------------------------------------------------------------------------

    def loop(self) -> int:
        lease: Lease | None = None
        while True:
            check_parent(self.parent)
            if self.stop_requested or self.retire_requested:
                self.give_back(lease)
                return ExitCode.OK
            if lease is None:
                # Cleared before the look, not after the wait: a nudge that comes while it
                # looks makes the wait below return at once (after it, it would be lost).
                self.nudge.clear()
                lease = self.lease()
            if lease is None:
                if not self.idle_reported:
                    self.channel.send(channel.Idle())
                    set_title(worker_title(self.options.number))
                    self.idle_reported = True
                    if self.dispatching():
                        continue  # asks again at once, parked: answered when work comes
                self.nudge.wait(self.idle_wait())
                continue
            self.idle_reported = False
            lease = self.run_step(lease)
            self.steps += 1
            if self.options.max_steps and self.steps >= self.options.max_steps:
                self.give_back(lease)
                return ExitCode.RECYCLE

    def wants_next(self) -> bool:
        """Whether recording a step may lease the next one in the same statement."""
        last = bool(self.options.max_steps) and self.steps + 1 >= self.options.max_steps
        return not (self.stop_requested or self.retire_requested or last)

    def give_back(self, lease: Lease | None) -> None:
        """Return a lease taken along with the last completion but never started."""
        if self.unsent is not None:
            self.channel.send(self.unsent)
            self.unsent = None
        if lease is None:
            return
        if self.given:
            # The supervisor saw this lease taken: it must not count it as held any more.
            self.given = False
            self.channel.send(channel.Idle(step_id=lease.step_id, token=lease.token))
        try:
            engine.release_step(self.db(), lease.step_id, lease.token)
        except psycopg.Error as exc:
            # It comes back through lease expiry instead (one attempt spent).
            log.warning("step %d: could not give its lease back: %s", lease.step_id, exc)

    def lease(self) -> Lease | None:
        if self.queue_ready():
            nxt = self.start_queued(b"")
            if nxt is not None:
                return nxt
        if self.dispatching():
            if self.idle_reported:
                given = self.ask(b'want {"lease":true,"park":true}\n', parked=True)
            else:
                given = self.ask(b'want {"lease":true}\n')
            if not given.own:
                return self.from_given(given)
        self.lease_sent = time.monotonic()
        try:
            return engine.lease_step(
                self.db(), worker=self.name, workflows=self.workflows,
                lease_ttl=self.options.lease_ttl, graphs=self.graphs(),
            )  # fmt: skip
        except psycopg.OperationalError as exc:
            # Nothing held, nothing at stake: the supervisor respawns us with backoff.
            log.error("worker %d lost its database: %s", self.options.number, exc)
            raise ChildExit(ExitCode.BOOT_ERROR) from None

    def graphs(self) -> tuple[str, ...]:
        """The graphs this worker may lease steps of (a failed look-up keeps the last)."""
        if self.served.due():
            try:
                self.served.refresh(self.db())
            except psycopg.Error as exc:
                if isinstance(exc, psycopg.OperationalError):
                    raise
                log.warning("worker %d: cannot look up graph versions: %s",
                            self.options.number, exc)  # fmt: skip
        return self.served.graphs

    def dispatching(self) -> bool:
        return self.options.dispatch and time.monotonic() >= self.own_until

    def idle_wait(self) -> float:
        """How long an idle worker waits for a nudge before it looks again: the poll interval,
        but while it leases on its own because dispatch failed, only until it may ask the
        supervisor again. Parked there, a step made ready wakes it; asleep for a poll interval,
        it slept past the outage, deaf to every wake (a minute, in tests)."""
        left = self.own_until - time.monotonic()
        if self.options.dispatch and left > 0:
            return min(self.options.poll_interval, left)
        return self.options.poll_interval

    def ask(self, line: bytes, parked: bool = False) -> channel.Given:
        """Send a `want` line (with a `done` report still unsent) and wait for the answer.

        Parked, it may wait for long: a stop or retire signal meanwhile is said with a `want`
        for no lease, which the supervisor answers at once (the first answer that comes is
        taken: a lease given before it read that line is given back by the loop)."""
        before, self.unsent = self.unsent, None
        self.channel.send_raw((channel.encode(before) if before else b"") + line)
        leaving = False
        while True:
            if parked and not leaving and (self.stop_requested or self.retire_requested):
                self.channel.send_raw(b'want {"lease":false}\n')
                leaving = True
            try:
                message = self.channel.receive(PARKED_POLL if parked else ANSWER_POLL)
            except (EOFError, OSError):
                raise ChildExit(ExitCode.ORPHANED) from None
            if isinstance(message, channel.Given):
                if message.own:
                    self.own_until = time.monotonic() + OWN_FOR
                return message
            if message is not None:
                self.take_line(message)
            check_parent(self.parent)

    def from_given(self, given: channel.Given) -> Lease | None:
        if given.lease is None:
            return None
        self.lease_sent = given.since if given.since is not None else time.monotonic()
        self.given = True
        if self.queue:
            # One of its queued leases, handed over in answer to a `want` that crossed it.
            step_id = given.lease["id"]
            self.queue = deque(q for q in self.queue if q.lease["id"] != step_id)
        return lease_of(given.lease, self.options.lease_ttl)

    # --- leases queued in its name ------------------------------------------------------------

    def take_line(self, message: channel.Message) -> None:
        """A line of the supervisor's other than the answer to a `want`."""
        if isinstance(message, channel.Queued):
            self.queue.append(message)
        elif isinstance(message, channel.Drop) and self.queue:
            self.queue = deque(
                q for q in self.queue
                if (q.lease["id"], q.lease["lease_token"]) != (message.step_id, message.token)
            )  # fmt: skip

    def queue_ready(self) -> bool:
        """Whether a queued lease waits to be started next (the lines that came are read
        first, without waiting: a `drop` among them is heeded)."""
        if not self.options.dispatch or not self.wants_next():
            return False
        try:
            messages = self.channel.poll()
        except (EOFError, OSError):
            raise ChildExit(ExitCode.ORPHANED) from None
        for message in messages:
            self.take_line(message)
        return bool(self.queue)

    def start_queued(
        self, before: bytes, finished: str | None = None, duration: float | None = None
    ) -> Lease | None:
        """Start the first queued lease still young, saying so (`took`, with `before` and the
        finished task, if any, for the supervisor to record); None when none was.

        The line is written before the lease's age is checked, and the clock read after the
        write: a lease started at all was started no later than `until`, and its line was in
        the supervisor's socket by then. The supervisor gives a queued lease back only once
        `until` passed and it read its worker's lines to the end, so it never gives back one
        that runs (dispatch.py, `Dispatcher.expire`)."""
        if self.unsent is not None:
            before = channel.encode(self.unsent) + before
            self.unsent = None
        while self.queue:
            queued = self.queue.popleft()
            row = queued.lease
            at = time.monotonic()
            line = f'took {{"step_id":{row["id"]},"token":"{row["lease_token"]}","at":{at!r}'
            if finished is not None:
                line += f',"duration":{duration!r},"finished":{finished}'
            self.channel.send_raw(before + line.encode() + b"}\n")
            before, finished = b"", None
            if time.monotonic() <= queued.until:
                self.lease_sent = queued.since
                self.given = True  # the supervisor learns of it from that line
                return lease_of(aged(row, at - queued.since), self.options.lease_ttl)
            # Too old to start: no longer this worker's. Given back (its attempt not spent),
            # as the supervisor would have, had it read the line a moment later.
            self.channel.send(channel.Idle(step_id=row["id"], token=row["lease_token"]))
            try:
                engine.release_step(self.db(), row["id"], row["lease_token"])
            except psycopg.Error as exc:
                log.warning("step %d: could not give its lease back: %s", row["id"], exc)
        return None

    def db(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.conn = self.connect()
        return self.conn

    def effects_db(self) -> psycopg.Connection[Any]:
        """The session handlers' fenced transactions run on, opened on first use."""
        conn = self.effects_conn
        if conn is None or conn.closed or conn.broken:
            conn = self.effects_conn = self.connect("cyclone-effects", hot=False)
            conn.autocommit = False
        return conn

    # --- one step -----------------------------------------------------------------------------

    def run_step(self, lease: Lease) -> Lease | None:
        """Run one step and record it; returns the next lease when the record took one."""
        leased_at = self.lease_sent
        self.report_lease(lease)
        set_title(worker_title(
            self.options.number, workflow=lease.workflow, node=lease.node, run_id=lease.run_id,
            attempt=lease.attempt,
        ))  # fmt: skip
        done = CancelEvent()
        effects = Effects(self.effects_db, lease.step_id, lease.token)
        self.keeper.hold(lease, done, leased_at)
        # Its duration counts from here: a lease may have waited in the queue since it was
        # taken, and the supervisor leases ahead only for steps that are short themselves.
        started = time.monotonic()
        try:
            outcome = runner.execute(self.db(), self.registry, lease, done=done, effects=effects)
        finally:
            # Whatever the handler started ends with its step, before the step is recorded.
            reaper.end_leftovers()
            renewed_at = self.keeper.release()
            self.wakeup.reclaim()
            self.install_signals()
        if self.stop_requested:
            # The supervisor stopped this attempt and writes its outcome once we are gone.
            raise ChildExit(ExitCode.STOPPED)
        outcome, written = self.settle(lease, outcome, effects)
        nxt = None
        if written is None:
            if self.queue_ready():
                return self.on_to_queued(lease, outcome, started, renewed_at)
            given = self.hand_over(lease, outcome, started)
            if given is not None:
                # The supervisor recorded the step and reported it: nothing more to say.
                if given.recorded is False:
                    log.warning("step %d: lease lost, result discarded", lease.step_id)
                return self.from_given(given)
            written, nxt = self.record(lease, outcome, renewed_at)
        report = self.report(lease, outcome, written, started)
        if nxt is None:
            self.channel.send(report)
        else:
            # The next step starts at once: its `leased` line carries this `done` along.
            self.unsent = report
        return nxt

    def on_to_queued(
        self, lease: Lease, outcome: runner.Outcome, started: float, renewed_at: float
    ) -> Lease | None:
        """Start the next queued lease: the finished task goes to the supervisor with the
        line that says so, or is recorded here first when it is not one the supervisor can
        record (then its `done` goes along)."""
        finished = self.finished_text(lease, outcome)
        if finished is not None:
            line_room = channel.MAX_LINE - 300  # the rest of the `took` line
            if len(finished) <= line_room:
                return self.start_queued(b"", finished, time.monotonic() - started)
        written, _ = self.record(lease, outcome, renewed_at, lease_next=False)
        return self.start_queued(channel.encode(self.report(lease, outcome, written, started)))

    def report(
        self, lease: Lease, outcome: runner.Outcome, written: bool, started: float
    ) -> channel.Done:
        """The `done` line of a step this worker recorded itself."""
        if self.record_outage is not None:  # the database answered again
            self.record_outage.succeeded()
            self.record_outage = None
        result = "lost" if not written else ("completed" if outcome.ok else "failed")
        if result == "completed" and lease.is_fanout:
            result = channel.EXPANDED  # a map's items are its steps: this row is none
        if not written:
            log.warning("step %d: lease lost, result discarded", lease.step_id)
        return channel.Done(
            step_id=lease.step_id, outcome=result, duration=time.monotonic() - started,
            error=None if outcome.ok else channel.first_line(outcome.error),
            retry=None if outcome.ok else outcome.retry and lease.attempt < lease.max_attempts,
            token=lease.token,
        )  # fmt: skip

    def finished_text(self, lease: Lease, outcome: runner.Outcome) -> str | None:
        """The finished task as the supervisor records it (dispatch.Finished's JSON), or None
        when it is not one it can record (see dispatch.py), or it said to lease alone."""
        if not (self.dispatching() and outcome.ok and lease.kind == NodeKind.TASK):
            return None
        if outcome.encoded is None:
            return None
        return finished_json(self.db(), lease, outcome.encoded)

    def hand_over(
        self, lease: Lease, outcome: runner.Outcome, started: float
    ) -> channel.Given | None:
        """Have the supervisor record a finished task and lease the next step with it; None
        when this step is not one it can record (see dispatch.py), or it said to lease alone."""
        finished = self.finished_text(lease, outcome)
        if finished is None:
            return None
        duration = time.monotonic() - started
        line = (
            f'want {{"lease":{"true" if self.wants_next() else "false"},'
            f'"duration":{duration!r},"finished":{finished}}}\n'
        ).encode()
        if len(line) > channel.MAX_LINE:
            return None  # recorded on this worker's own session instead
        given = self.ask(line)
        # `own`, or this batch failed: the step is recorded here, on the worker's own session.
        return None if given.own or (given.recorded is None and not given.taken) else given

    def report_lease(self, lease: Lease) -> None:
        # The durations were read on the database clock as the lease was taken, just before
        # this: the supervisor adds them to its own clock as the line arrives.
        if self.given:
            self.given = False  # the supervisor took it, and reported it itself
            return
        before, self.unsent = self.unsent, None
        self.channel.send(*([before] if before else []), channel.Leased(
            step_id=lease.step_id, token=lease.token, run_id=lease.run_id,
            workflow=lease.workflow, node=lease.node, attempt=lease.attempt,
            kill_after=lease.kill_after, deadline_left=lease.deadline_left,
            since=self.lease_sent, item=lease.item_index,
        ))  # fmt: skip

    def record(
        self, lease: Lease, outcome: runner.Outcome, renewed_at: float, lease_next: bool = True
    ) -> tuple[bool, Lease | None]:
        if lease_next and self.wants_next():
            try:
                # One commit per step: the completion and the next lease travel together.
                self.lease_sent = time.monotonic()
                return runner.record_and_lease(
                    self.db(), lease, outcome, worker=self.name, workflows=self.workflows,
                    lease_ttl=self.options.lease_ttl, graphs=self.graphs(),
                )  # fmt: skip
            except psycopg.OperationalError as exc:
                self.check_trust(lease, renewed_at, exc)
        while True:
            try:
                return runner.record(self.db(), lease, outcome), None
            except psycopg.OperationalError as exc:
                # A write that committed before the connection broke reads as lost on retry,
                # which is right: the fenced write cannot happen twice.
                self.check_trust(lease, renewed_at, exc)
                # A nudge left set by a signal would make this wait return at once, every time.
                self.nudge.clear()
                self.nudge.wait(min(1.0, self.options.heartbeat_interval))

    def settle(
        self, lease: Lease, outcome: runner.Outcome, effects: Effects
    ) -> tuple[runner.Outcome, bool | None]:
        """Commit what the handler wrote through ctx.transaction() with its completion."""
        try:
            return outcome, runner.record_effects(effects, lease, outcome)
        except psycopg.Error as exc:
            # Maybe committed, maybe not: a fenced failure is right either way (it changes
            # nothing when the completion went through), a completion without effects is not.
            log.warning("step %d: its transaction did not commit: %s", lease.step_id, exc)
            return runner.Outcome.failed(f"the step's transaction did not commit: {exc}"), None

    def check_trust(self, lease: Lease, renewed_at: float, exc: Exception) -> None:
        ttl, beat = self.options.lease_ttl, self.options.heartbeat_interval
        # The supervisor renews the lease while the worker retries its record.
        renewed_at = self.keeper.renewed_at(lease, renewed_at)
        # Retried every second: one warning per outage (and a reminder each 30 s), not each.
        if self.record_outage is None or self.record_outage.what != f"step {lease.step_id}":
            self.record_outage = OutageLog(log, f"step {lease.step_id}")
        self.record_outage.failed(exc)
        if not may_go_on(lease, renewed_at, ttl, beat, exc):
            log.error("step %d: its lease may lapse: leaving it, unrecorded", lease.step_id)
            raise ChildExit(ExitCode.LEASE_LOST)

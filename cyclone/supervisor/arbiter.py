"""The supervisor's decisions: who to spawn, who to kill and when, what to record, when to stop.

The arbiter owns no wait point and no clock of its own: the loop in `supervisor.py` feeds it
signals, pipe data and notifications, then calls `tick()`, which reaps, enforces deadlines and
manages the worker count (gunicorn's reap_workers / murder_workers / manage_workers). Every OS
call goes through `ProcessOps` and every database call through `Store`, so tests drive it with
a fake process layer and a fake clock.

Killing a worker is two-staged: SIGTERM asks it to stop cooperatively (its handler sees
`ctx.done`), and `kill_grace` later the whole process group gets SIGKILL, grandchildren
included. The step's outcome is written, fenced by the lease token, once the process is dead.
Two kills get no grace, because another worker may run the step next: a worker whose lease
was not renewed in time (SIGKILL a heartbeat interval before the lease can lapse in the
database: see `lease_trust`), and one whose lease the scanner already reclaimed.

The arbiter renews its busy workers' leases itself (`renew_leases`): every heartbeat interval,
one statement for all the workers the OS says are alive and not stopped (/proc), so that a
handler holding the GIL in one long C call, which starves any thread of its own, is never
taken for a dead one. What vouches for a running step is then the kernel's word on its process
and the supervisor's loop, never a thread inside the worker; a frozen worker is not renewed
and is SIGKILLed before its lease can lapse, as before.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

from cyclone.child import channel
from cyclone.child.lease import RenewalBoard, lease_trust
from cyclone.engine.steps import FINISHED
from cyclone.errors import CycloneError
from cyclone.outage import OutageLog, one_line
from cyclone.states import DEADLINE_ERROR, ErrorKind
from cyclone.supervisor.children import (
    ExitBy,
    ExitStatus,
    HeldLease,
    KillOrder,
    KillReason,
    Role,
    WorkerHandle,
    describe_exit,
    exit_by,
    held_lease,
)
from cyclone.supervisor.outcomes import (
    RUN_ENDED,
    format_elapsed,
    log_outcome,
    step_extra,
    step_label,
)
from cyclone.supervisor.ports import (
    ArbiterConfig,
    ChildFactory,
    Events,
    NullEvents,
    NullWatcher,
    Reloader,
    Renewals,
    Store,
    Traces,
    Watcher,
)
from cyclone.supervisor.processes import RETIRE_SIGNAL, STOP_SIGNAL, ProcessOps

log = logging.getLogger(__name__)

# Respawn backoff after boot failures: doubling from BOOT_BACKOFF up to BOOT_BACKOFF_CAP, and
# a halt after MAX_BOOT_FAILURES in a row. Generous on purpose: the usual boot failure is a
# database restart, which takes seconds; a broken install fails the supervisor's own boot.
BOOT_BACKOFF = 0.5
BOOT_BACKOFF_CAP = 30.0
MAX_BOOT_FAILURES = 10
# A child that crashes this soon after its fork, before it ran a step, counts as a boot
# failure though it said it booted (see failed_to_boot).
FAST_EXIT = 1.0
# Exits that a booted child decides on for reasons that say nothing of its boot: never a boot
# failure, however soon they come (a worker leased a step of a run cancelled a moment later).
NOT_BOOT_EXITS = (
    channel.ExitCode.OK, channel.ExitCode.RECYCLE, channel.ExitCode.LEASE_LOST,
    channel.ExitCode.STOPPED, channel.ExitCode.ORPHANED,
)  # fmt: skip
# After a database call failed, the next revocation poll waits this long: during an outage
# each attempt can block the loop for a connect timeout, and kills must stay on time.
DB_RETRY = 5.0
# With notifications working, polling for revoked leases is only a safety net.
LISTEN_POLL_FACTOR = 10
# A worker records its step, then reports it over its pipe: a revocation check can fall in
# between, for tens of ms on a loaded host (bench/README.md, "Figures behind the code's
# comments"). Such a lease is not revoked, and its worker is killed only if the report has not
# come this long after the database showed the record.
REPORT_WAIT = 2.0
# A child's channel is read for at most this many bytes a pass of the loop: one flooding its
# channel cannot hold the loop, and the other workers' kills, up.
READ_BUDGET = 256 * 1024
# Lines a second a child may send. A worker sends two or three a step, and no-op steps run a
# few thousand a second at most; more is a flood (a handler writing to the channel's
# descriptor), and the child is killed for it.
FLOOD_LINES = 20_000
# The longest the loop sleeps, so it re-checks its children even when nothing wakes it.
MAX_TICK = 1.0
EXIT_HALTED = 3

# Why the database revoked a lease (the step's error kind) -> why we kill its worker. Anything
# else (the run failed elsewhere, or the row is gone) counts as a cancel.
REVOKE_REASONS = {
    "cancelled": KillReason.CANCEL,
    "deadline": KillReason.DEADLINE,
    "lease_expired": KillReason.LEASE_EXPIRED,
}
# Kills that cannot wait for a cooperative stop: the step may be (or soon be) someone else's.
NO_GRACE = (
    KillReason.SILENT, KillReason.FROZEN, KillReason.LOST_SESSION, KillReason.LEASE_EXPIRED
)  # fmt: skip
# A /proc state letter of a process that runs no code until someone else acts: stopped by a
# signal (SIGSTOP, SIGTSTP) or by a debugger. (The cgroup freezer's tasks read as sleeping.)
STOPPED = ("T", "t")
# After a renewal failed (its session lost: a restart, a terminated backend), the next try
# waits this long, and at most a quarter of a heartbeat interval: a failed renewal must cost
# nothing while the next one can still land within the lease's trust (two heartbeats at
# least), and a try against a server that refuses connections costs little.
RENEW_RETRY = 1.0
# A renewal statement unanswered this long (its statement_timeout is 2 s) is given up on, its
# session dropped: the network may have swallowed it, and no answer would ever come.
RENEW_WAIT = 3.0
# A busy worker whose last renewal is older than this many heartbeat intervals is late: its
# silent kill then counts among the kills the loop's own database calls must not hold up.
LATE_BEATS = 1.5


class Arbiter:
    def __init__(
        self,
        config: ArbiterConfig,
        *,
        ops: ProcessOps,
        clock: Callable[[], float],
        store: Store,
        factory: ChildFactory,
        reload: Reloader | None = None,
        watcher: Watcher | None = None,
        events: Events | None = None,
        # The dispatcher's: (handle, want) for a `want`, (handle, took, finished lease) for a
        # `took`.
        wants: Callable[..., None] | None = None,
        renewer: Renewals | None = None,
        board: RenewalBoard | None = None,
        traces: Traces | None = None,
        give_back: Callable[[list[Any]], None] | None = None,
        revoke_queued: Callable[[WorkerHandle, Any], None] | None = None,
    ) -> None:
        self.config = config
        # Leases queued for a worker that left without starting them go back through this
        # (the dispatcher's steps_release); without it, they lapse.
        self.give_back = give_back
        # A queued lease found revoked goes to this (the dispatcher tells the worker to drop it).
        self.revoke_queued = revoke_queued
        self.traces = traces
        self.renewer = renewer
        self.board = board
        # The renewal statement in flight: its leases by step id (with the token asked for),
        # and when it was sent; the lease's new term runs from no earlier than that.
        self.renewing: dict[int, tuple[WorkerHandle, str]] = {}
        self.renewal_sent = 0.0
        # The last renewal failed or could not be sent: a kill for silence is then one for
        # the lost session, not the worker's doing.
        self.renewals_failing = False
        self.next_renewal_try = 0.0
        self.wants = wants
        self.ops = ops
        self.clock = clock
        self.store = store
        self.factory = factory
        self.reload = reload
        self.watcher = watcher or NullWatcher()
        self.events = events or NullEvents()
        self.children: dict[int, WorkerHandle] = {}
        self.target = config.workers
        self.generation = 0
        self.boot_failures = 0
        self.next_spawn_at = 0.0
        self.database_down = False
        self.notifications = False
        self.notified = False
        self.next_poll = 0.0
        self.draining = False
        self.drain_deadline: float | None = None
        self.halted = False
        self.finished = False
        self.exit_code = 0
        self.kills: dict[KillReason, int] = {}
        # An outage is one warning, then a reminder every 30 s, not one per poll (DB_RETRY).
        self.revocation_outage = OutageLog(log, "checking for revoked leases", clock=clock)

    # --- inputs -------------------------------------------------------------------------------

    def handle_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name.lower().removeprefix("sig")
        handler = getattr(self, f"handle_{name}", None)
        if handler is not None:
            handler()

    def handle_term(self, name: str = "SIGTERM") -> None:
        if self.draining:
            log.warning(
                "second stop signal (%s): killing every child", name, extra={"action": "kill_all"}
            )  # fmt: skip
            self.kill_all(KillReason.SHUTDOWN)
        else:
            self.begin_drain(name)

    def handle_int(self) -> None:
        self.handle_term("SIGINT")

    def handle_chld(self) -> None:
        pass  # the wake-up was the point; tick() reaps

    def handle_ttin(self) -> None:
        self.target += 1
        log.info("workers: %d", self.target, extra={"action": "resize"})

    def handle_ttou(self) -> None:
        if self.target > 1:
            self.target -= 1
            log.info("workers: %d", self.target, extra={"action": "resize"})

    def handle_hup(self) -> None:
        if self.reload is None:
            log.warning("SIGHUP ignored: started without --config, there is nothing to reload")
            return
        if self.draining:
            log.warning("SIGHUP ignored: draining")
            return
        try:
            config, factory = self.reload()
        except CycloneError as exc:
            log.error("reload failed, keeping the old config: %s", exc, extra={"action": "reload"})
            return
        self.config, self.factory, self.target = config, factory, config.workers
        self.generation += 1
        # New workers start now; the old ones finish their current step and leave.
        for handle in self.children.values():
            if not handle.retiring and handle.kill is None:
                self.retire(handle)
        log.info("config reloaded; replacing children", extra={"action": "reload"})

    def on_readable(self, fd: int) -> None:
        for handle in self.children.values():
            if handle.fd == fd:
                self.read_channel(handle)
                return

    def on_notify(self) -> None:
        self.notified = True

    def set_notifications(self, working: bool) -> None:
        self.notifications = working

    # --- the tick -----------------------------------------------------------------------------

    def start(self) -> None:
        self.manage_workers()

    def tick(self) -> None:
        self.reap_workers()
        if self.finished:
            return
        self.check_revocations()
        self.enforce_deadlines()
        self.renew_leases()
        self.manage_workers()

    def next_wakeup(self) -> float:
        """When tick() next has something to do, on the arbiter's clock."""
        now = self.clock()
        times = [now + MAX_TICK]
        kill_at = self.next_kill_at()
        if kill_at is not None:
            times.append(kill_at)
        times += [self.silent_at(h.lease) for h in self.busy() if h.kill is None and h.lease]
        renew_at = self.next_renewal_at()
        if renew_at is not None:
            times.append(renew_at)
        if any(h.kill is None and h.lease is not None for h in self.children.values()):
            times.append(self.next_poll)  # a busy worker's lease may be revoked
        if not self.draining and self.missing() > 0:
            times.append(self.next_spawn_at)
        return max(now, min(times))

    def next_kill_at(self) -> float | None:
        """The earliest moment a kill may be due, on the arbiter's clock; None: none is.

        The loop's own database calls (presence) run only when this is far enough away, so
        that they can never hold a kill up. A silent worker's kill counts once its renewal is
        late: a busy worker that heartbeats on time is never near it, and counting it always
        would hold those calls off for good under a short lease_ttl.
        """
        times: list[float] = []
        now = self.clock()
        late = LATE_BEATS * self.config.heartbeat_interval
        for handle in self.children.values():
            if handle.kill is not None:
                # Killed: only the SIGKILL is still to come; then we wait for SIGCHLD.
                if not handle.kill.hard_sent:
                    times.append(handle.kill.hard_at)
            elif handle.lease is not None:
                times += [t for t in (handle.lease.timeout_at, handle.lease.deadline_at) if t]
                if now - self.renewed_at(handle.lease) > late:
                    times.append(self.silent_at(handle.lease))
        if self.drain_deadline is not None:
            times.append(self.drain_deadline)
        return min(times, default=None)

    # --- reading channels ---------------------------------------------------------------------

    def read_channel(self, handle: WorkerHandle) -> None:
        """Act on what a child wrote, READ_BUDGET bytes at most (the selector calls again for
        the rest). A child's lines are not trusted: one that is no message, a flood, or a
        message this code fails on costs that child alone, which is killed (`bad_message`)."""
        budget = READ_BUDGET
        while budget > 0 and not handle.deaf:
            data = self.ops.read(handle.fd)
            if data == b"":
                # End of file before the exit is reaped (or a grandchild still holds the
                # pipe): stop watching, or the selector reports the fd readable forever.
                self.watcher.unwatch(handle.fd)
                handle.eof = True
            if not data:
                return
            budget -= len(data)
            lines = handle.buffer.feed(data)
            if handle.buffer.dropped:
                self.bad_message(handle, f"a line over {channel.MAX_LINE} bytes")
                return
            now = self.clock()
            if now - handle.lines_since >= 1.0:
                handle.lines, handle.lines_since = 0, now
            handle.lines += len(lines)
            if handle.lines > FLOOD_LINES:
                self.bad_message(handle, f"over {FLOOD_LINES} lines in a second (a flood)")
                return
            for line in lines:
                try:
                    message = channel.decode(line)
                    if isinstance(message, channel.SUPERVISORS):
                        raise channel.ProtocolError(f"{message.verb} is the supervisor's to send")
                    self.on_message(handle, message)
                except channel.ProtocolError as exc:
                    self.bad_message(handle, str(exc))
                    return
                except Exception as exc:  # a message this code cannot act on: its sender's
                    log.exception("%s: acting on its message failed", handle.label)
                    self.bad_message(handle, f"{type(exc).__name__}: {exc}")
                    return

    def bad_message(self, handle: WorkerHandle, why: str) -> None:
        """Kill a child for what it wrote; what it writes from now on is not read. One warning
        per child killed: a flood of bad lines is one line in the log."""
        handle.deaf = True
        self.watcher.unwatch(handle.fd)
        log.warning("%s sent a bad message (%s): killing it", handle.label, why)
        if handle.kill is None:
            error = f"worker sent a bad message: {why}"
            self.order_kill(handle, KillReason.BAD_MESSAGE, ErrorKind.CRASHED, error, grace=0)

    def on_message(self, handle: WorkerHandle, message: channel.Message) -> None:
        now = self.clock()
        handle.last_seen = now
        if isinstance(message, channel.Ready):
            handle.booted = True
            self.boot_failures = 0
        elif isinstance(message, channel.Leased):
            self.watch_lease(handle, message, now)
        elif isinstance(message, channel.Done):
            # Only a report naming the step and its token ends a lease's watch: a line the
            # handler forged would otherwise switch its own timeout off.
            if self.names(handle.lease, message.step_id, message.token):
                self.step_finished(handle.lease, message)
                handle.lease = None
            handle.steps += 1
        elif isinstance(message, channel.Idle):
            if self.names(handle.lease, message.step_id, message.token):
                handle.lease = None  # a lease taken for it and never started, given back
        elif isinstance(message, channel.Exit):
            handle.exit_said = message.code
        elif isinstance(message, channel.Took):
            held = self.took(handle, message, now)
            if self.wants is not None:
                self.wants(handle, message, held)
        elif isinstance(message, channel.Want) and self.wants is not None:
            self.wants(handle, message)
        elif isinstance(message, channel.Scanned):
            self.events.scanned(message)
            if not message.ok:
                self.database_failed()
            elif message.counts:  # a pass that ran its sweeps: the database answered
                self.database_answered()

    @staticmethod
    def names(lease: HeldLease | None, step_id: int | None, token: str | None) -> bool:
        return lease is not None and lease.step_id == step_id and lease.token == token

    def handed_over(self, handle: WorkerHandle, leased: channel.Leased) -> HeldLease | None:
        """The worker finished its step and took a lease the supervisor held ready for it
        (supervisor/dispatch.py): it holds the new lease now. The finished step's outcome is
        known once it is recorded (`step_finished`); the lease it was is returned for that."""
        finished = handle.lease
        handle.lease = None
        handle.steps += 1
        self.on_message(handle, leased)
        return finished

    def took(self, handle: WorkerHandle, message: channel.Took, now: float) -> HeldLease | None:
        """The worker started a lease queued in its name (supervisor/dispatch.py), having
        finished the step it held (returned: its outcome is known once the supervisor's next
        statement recorded it), if the line says so. Its step's timeout counts from when the
        worker started it, not from when it was queued. A lease no longer queued for it (given
        back as too old: the worker then found it too old too, and does not run it) is not."""
        finished = None
        if message.finished is not None:
            f = message.finished
            if self.names(handle.lease, f["step_id"], f["token"]):
                finished, handle.lease = handle.lease, None
            handle.steps += 1
        key = (message.step_id, message.token)
        ready = next((r for r in handle.queued if r.key == key), None)
        if ready is None:
            return finished
        handle.queued.remove(ready)
        # The worker's clock is the host's monotonic clock, as ours; its word is bounded by
        # what we know: not before the lease was taken, not after we read the line.
        at = min(max(message.at, ready.sent), now)
        self.watch_lease(handle, ready.started(at), at)
        if ready.revoked:
            self.notified = True  # started before it read the `drop`: killed at once
        return finished

    def watch_lease(self, handle: WorkerHandle, message: channel.Leased, now: float) -> None:
        handle.lease = held_lease(message, now)
        self.events.leased(handle.lease)
        if self.traces is not None:
            self.traces.started(handle.lease)

    def step_finished(self, lease: HeldLease | None, done: channel.Done) -> None:
        """A step's outcome, for the lease it was: from its worker's `done`, or once recorded
        for a worker that took its next step already (see handed_over)."""
        if lease is not None and lease.step_id == done.step_id:
            if done.outcome != channel.EXPANDED:  # a map's items are its steps, counted as they end
                self.events.finished(lease, done.outcome, done.duration)
            if self.traces is not None:
                self.traces.reported(lease, done)
            log_outcome(lease, done)

    def may_lease(self, handle: WorkerHandle, finishing: int | None = None) -> bool:
        """Whether a step may be leased for this worker (see supervisor/dispatch.py): not one
        leaving, killed, of an old config, or holding a step other than `finishing`."""
        return (
            handle.role is Role.WORKER and not self.draining and not handle.retiring
            and handle.kill is None and handle.generation == self.generation
            and (handle.lease is None or handle.lease.step_id == finishing)
        )  # fmt: skip

    # --- reaping ------------------------------------------------------------------------------

    def reap_workers(self) -> None:
        for pid, status in self.ops.reap():
            handle = self.children.pop(pid, None)
            if handle is None:
                continue  # not ours (we may be PID 1 in a container): reaped quietly
            # Grandchildren a handler spawned die with their worker, whatever ended it.
            self.ops.signal_group(pid, signal.SIGKILL)
            self.read_channel(handle)  # a last `done` or `leased` may still be in the pipe
            self.watcher.unwatch(handle.fd)
            self.ops.close(handle.fd)
            if self.board is not None:
                self.board.give_back(handle.slot)  # dead: nobody reads that slot any more
            if handle.queued:
                # Its last lines are read: the leases queued for it that it never started
                # go back, their attempts not spent (without a dispatcher, they lapse).
                queued, handle.queued = handle.queued, []
                if self.give_back is not None:
                    self.give_back(queued)
            self.after_exit(handle, status)
        if (self.draining or self.halted) and not self.children:
            self.finished = True
            log.info("all children gone; exiting %d", self.exit_code, extra={"action": "exit"})

    def after_exit(self, handle: WorkerHandle, status: ExitStatus) -> None:
        kill, lease = handle.kill, handle.lease
        level = logging.INFO if kill or handle.retiring else logging.WARNING
        if status.signal == signal.SIGKILL and kill is None:
            level, note = logging.ERROR, " (not by us: possibly the OOM killer)"
        else:
            note = ""
        log.log(level, "%s %s%s", handle.label, status.describe(), note, extra={"action": "exit"})
        self.events.exited(handle, status)
        if self.traces is not None and lease is not None:
            self.trace_exit(lease, kill, handle, status)
        if kill is not None and lease is not None and kill.step_id == lease.step_id:
            if kill.release and kill.token is not None:
                self.release(lease, kill.reason)
            elif kill.record is not None and kill.token is not None:
                self.record(lease, kill.record, kill.error)
            else:
                # The database revoked the lease and already holds the outcome.
                log.info(
                    "%s killed after %s (%s)%s", step_label(lease),
                    format_elapsed(self.clock() - lease.leased_at), kill.reason,
                    RUN_ENDED.get(kill.reason, ""), extra=step_extra(lease, "record"),
                )  # fmt: skip
        elif (
            lease is not None
            and status.code == channel.ExitCode.LEASE_LOST
            and exit_by(handle, status) is ExitBy.CHILD
            and self.renewals_failing
        ):
            # Its keeper stopped it, its lease not renewed, a moment before our kill for the
            # lost session would have (which wins is a matter of scheduling): the same outcome.
            self.release(lease, KillReason.LOST_SESSION)
        elif lease is not None:
            # Died on its own mid-step (or mid a step leased after the one we killed it for).
            self.record(lease, ErrorKind.CRASHED, describe_exit(handle, status))
        unasked = kill is None and not handle.retiring and not self.draining
        if unasked and self.failed_to_boot(handle, status):
            self.boot_failed(handle)

    def trace_exit(
        self, lease: HeldLease, kill: KillOrder | None, handle: WorkerHandle, status: ExitStatus
    ) -> None:
        """The supervisor ends the span of an attempt its worker did not finish: with the
        kill's reason, or as crashed."""
        assert self.traces is not None
        if kill is not None and kill.step_id == lease.step_id:
            outcome = "released" if kill.release else "killed"
            self.traces.ended(lease, outcome, f"killed ({kill.reason}): {kill.error}", kill.reason)
        else:
            self.traces.ended(lease, "crashed", describe_exit(handle, status), "crashed")

    def failed_to_boot(self, handle: WorkerHandle, status: ExitStatus) -> bool:
        """Whether an exit we did not ask for counts toward the respawn backoff and the halt.

        Judged by what the child said, not by how soon it left: a child that never said
        `ready`, or that says it cannot reach its database (BOOT_ERROR, its own exit after
        boot: a worker whose database went away), failed to boot. A booted child's own exits
        for other reasons (NOT_BOOT_EXITS) and a handler's exit (the step is its record) never
        count. One exception guards against forking as fast as we can: a booted child that
        crashed before it ran a step, within FAST_EXIT of its fork (its database lacks the
        schema, a native module it imports segfaults).
        """
        if not handle.booted:
            return status.code not in NOT_BOOT_EXITS
        by = exit_by(handle, status)
        if by is ExitBy.HANDLER or status.code in NOT_BOOT_EXITS:
            return False
        if status.code == channel.ExitCode.BOOT_ERROR:
            return True
        idle_so_far = handle.steps == 0 and handle.lease is None
        return idle_so_far and self.clock() - handle.spawned_at < FAST_EXIT

    def database_failed(self) -> None:
        """Someone (the scanner, presence) found the database down: workers cannot boot."""
        self.database_down = True

    def database_answered(self) -> None:
        """The database answers again: children that failed to boot during the outage are
        spawned now, not when a backoff of up to BOOT_BACKOFF_CAP runs out."""
        if not self.database_down:
            return
        self.database_down = False
        if self.boot_failures:
            log.info(
                "the database answers again: spawning now (backoff reset)",
                extra={"action": "spawn"},
            )  # fmt: skip
            self.boot_failures = 1  # still one probe at a time until a child boots
            self.next_spawn_at = self.clock()

    def boot_failed(self, handle: WorkerHandle) -> None:
        self.boot_failures += 1
        # An outage is not a broken install: wait it out (backing off) rather than halt.
        if self.boot_failures >= MAX_BOOT_FAILURES and not self.database_down:
            log.critical(
                "%d children in a row failed to boot; halting", self.boot_failures,
                extra={"action": "halt"},
            )  # fmt: skip
            self.halt()
            return
        delay = min(BOOT_BACKOFF * 2 ** (self.boot_failures - 1), BOOT_BACKOFF_CAP)
        self.next_spawn_at = self.clock() + delay
        log.warning("%s failed to boot; next spawn in %.1fs", handle.label, delay)

    def record(self, lease: HeldLease, kind: ErrorKind, error: str) -> None:
        try:
            written = self.store.fail_step(lease.step_id, lease.token, kind, error)
        except Exception as exc:  # the database is down: lease expiry is the backstop
            log.error("could not record step %d as %s: %s", lease.step_id, kind, one_line(exc))
            return
        if written:
            elapsed = self.clock() - lease.leased_at
            self.events.finished(lease, str(kind), elapsed)
            log.info(
                "%s recorded as %s after %s: %s", step_label(lease), kind, format_elapsed(elapsed),
                error, extra=step_extra(lease, "record"),
            )  # fmt: skip

    def release(self, lease: HeldLease, reason: KillReason) -> None:
        """A step stopped by a planned stop goes back with its attempt not spent."""
        try:
            released = self.store.release_step(lease.step_id, lease.token)
        except Exception as exc:  # the database is down: lease expiry is the backstop
            log.error("could not release step %d: %s", lease.step_id, one_line(exc))
            return
        if released:
            log.info(
                "%s released after %s (%s): attempt not spent", step_label(lease),
                format_elapsed(self.clock() - lease.leased_at), reason,
                extra=step_extra(lease, "record"),
            )  # fmt: skip

    # --- killing ------------------------------------------------------------------------------

    def check_revocations(self) -> None:
        """Kill workers whose lease the database revoked (run cancelled, failed, overdue)."""
        now = self.clock()
        if not (self.notified or now >= self.next_poll):
            return  # the loop calls this at every wake-up: nothing gathered until it is time
        held = {h.lease.step_id: h.lease.token for h in self.busy() if h.kill is None}
        queued = {r.key[0]: (h, r) for h in self.workers() for r in h.queued if not r.revoked}
        held.update((step_id, r.key[1]) for step_id, (_, r) in queued.items())
        if not held:
            return
        self.notified = False
        factor = LISTEN_POLL_FACTOR if self.notifications else 1
        self.next_poll = now + self.config.poll_interval * factor
        try:
            revoked = self.store.revoked(held)
        except Exception as exc:
            self.revocation_outage.failed(exc)
            self.next_poll = now + DB_RETRY
            return
        self.revocation_outage.succeeded()
        for step_id, (handle, ready) in queued.items():
            if revoked.get(step_id, FINISHED) != FINISHED and self.revoke_queued is not None:
                self.revoke_queued(handle, ready)
        for handle in self.busy():
            lease = handle.lease
            if lease is None or lease.step_id not in revoked or handle.kill is not None:
                continue
            self.read_channel(handle)  # it may have finished the step a moment ago
            if handle.lease is not lease:
                continue
            why = revoked[lease.step_id]
            if why == FINISHED:
                # Recorded by its holder, whose report is on its way: no kill, unless the
                # report never comes (the worker is stuck past its own write).
                if lease.finished_seen is None:
                    lease.finished_seen = now
                if now - lease.finished_seen < REPORT_WAIT:
                    self.next_poll = min(self.next_poll, lease.finished_seen + REPORT_WAIT)
                    continue
                why = None
            reason = REVOKE_REASONS.get(why or "", KillReason.CANCEL)
            self.order_kill(handle, reason, record=None, error="lease revoked")

    def enforce_deadlines(self) -> None:
        now = self.clock()
        for handle in list(self.children.values()):
            kill, lease = handle.kill, handle.lease
            if kill is not None:
                if not kill.hard_sent and now >= kill.hard_at:
                    self.hard_kill(handle)
            elif lease is not None and lease.timeout_at is not None and now >= lease.timeout_at:
                error = f"attempt {lease.attempt} ran past its timeout"
                self.order_kill(handle, KillReason.TIMEOUT, ErrorKind.TIMEOUT, error)
            elif lease is not None and lease.deadline_at is not None and now >= lease.deadline_at:
                self.deadline_passed(handle, lease)
            elif lease is not None and now >= self.silent_at(lease) and self.still_silent(handle):
                self.kill_silent(handle, lease, now)
        if self.drain_deadline is not None and now >= self.drain_deadline:
            self.drain_deadline = None
            log.warning("shutdown_timeout passed: killing", extra={"action": "kill_all"})
            self.kill_all(KillReason.SHUTDOWN)

    @staticmethod
    def renewed_at(lease: HeldLease) -> float:
        return lease.leased_at if lease.renewed_at is None else lease.renewed_at

    # --- renewing -----------------------------------------------------------------------------

    def next_renewal_at(self) -> float | None:
        """When the next renewal statement is due (None: no lease to renew, or one in flight).

        A lease is due a heartbeat interval after its last renewal; the statement then renews
        every lease at least half that old too, so that the leases of a VM fall into step and
        cost one statement a heartbeat interval, not one each."""
        if self.renewer is None or self.config.heartbeat_interval <= 0:
            return None
        if self.renewer.in_flight:
            return self.renewal_sent + RENEW_WAIT
        due = [
            self.renewed_at(h.lease) + self.config.heartbeat_interval
            for h in self.busy() if h.kill is None and h.lease is not None
            and h.os_state not in STOPPED
        ]  # fmt: skip
        if not due:
            return None
        return max(min(due), self.next_renewal_try)

    def renew_leases(self) -> None:
        """Renew, in one statement, the leases of the busy workers the OS vouches for (what it
        costs, against each worker renewing its own: bench/README.md, "renewals.py")."""
        if self.renewer is None:
            return
        now = self.clock()
        if self.renewer.in_flight and now - self.renewal_sent > RENEW_WAIT:
            self.renewer.close()
            self.renewal_failed(TimeoutError(f"no answer in {RENEW_WAIT:.0f}s"))
        if self.renewer.in_flight:
            return
        # A stopped worker's lease is not due (it is not renewed), but the worker is looked at
        # again each tick: one resumed (SIGCONT) in time is renewed with the others.
        for handle in self.busy():
            if handle.kill is None and handle.os_state in STOPPED:
                self.vouch(handle, now)
        renew_at = self.next_renewal_at()
        if renew_at is None or now < renew_at:
            return
        half = self.config.heartbeat_interval / 2
        asked = {
            h.lease.step_id: (h, h.lease.token) for h in self.busy()
            if h.kill is None and h.lease is not None
            and now - self.renewed_at(h.lease) >= half and self.vouch(h, now)
        }  # fmt: skip
        if not asked:
            return
        try:
            self.renewer.send([(step_id, token) for step_id, (_, token) in asked.items()])
        except Exception as exc:
            self.renewal_failed(exc)
            return
        self.renewing, self.renewal_sent = asked, now

    def vouch(self, handle: WorkerHandle, now: float) -> bool:
        """Whether the OS says this worker runs: alive, not stopped, its channel open. A hung
        handler passes (its step's timeout ends it); a frozen one does not, and is killed before
        its lease can lapse. The CPU time is kept only to say how long it made no progress."""
        state = self.ops.state(handle.pid)
        if state is None:
            handle.os_state = "X"  # gone: the reaper records its step
            return False
        handle.os_state, cpu = state
        if cpu != handle.cpu:
            handle.cpu, handle.cpu_still_since = cpu, now
        return handle.os_state not in (*STOPPED, "Z", "X") and not handle.eof

    def renewed(self, renewed: set[int]) -> None:
        """The renewal statement's answer: the step ids whose leases it renewed."""
        asked, sent = self.renewing, self.renewal_sent
        self.renewing = {}
        self.renewals_failing = False
        log.debug(
            "renewed %d of %d leases in one statement (%.1f ms)", len(renewed), len(asked),
            (self.clock() - sent) * 1000, extra={"action": "renew"},
        )  # fmt: skip
        for step_id, (handle, token) in asked.items():
            lease = handle.lease
            if lease is None or lease.step_id != step_id or lease.token != token:
                continue  # finished (or another step) since: nothing to say about it
            if step_id in renewed:
                lease.renewed_at = max(self.renewed_at(lease), sent)
                if self.board is not None and handle.slot is not None:
                    self.board.write(handle.slot, step_id, sent)
            else:
                # Revoked or reclaimed (or recorded a moment ago): the database says which.
                self.notified = True

    def renewal_failed(self, exc: Exception) -> None:
        """The renewal statement failed or could not be sent: the leases are not renewed; the
        workers are killed as their trust runs out, for the lost session (`kill_silent`)."""
        if not self.renewals_failing:
            log.warning(
                "could not renew the workers' leases: %s", one_line(exc),
                extra={"action": "renew"},
            )  # fmt: skip
        self.renewing = {}
        self.renewals_failing = True
        self.next_renewal_try = self.clock() + min(RENEW_RETRY, self.config.heartbeat_interval / 4)

    def kill_silent(self, handle: WorkerHandle, lease: HeldLease, now: float) -> None:
        """Its lease was not renewed in time and may lapse: SIGKILL now, saying why."""
        if handle.os_state in STOPPED:
            still = now - handle.cpu_still_since
            error = f"worker frozen (stopped, no CPU for {still:.1f}s): its lease was not renewed"
            self.order_kill(handle, KillReason.FROZEN, ErrorKind.CRASHED, error)
        elif self.renewals_failing or lease.step_id in self.renewing:
            # Not the step's doing: it goes back with its attempt not spent, when the database
            # takes the release; when it does not, the lease lapses (see operators.md).
            error = "the supervisor lost its database session: the lease could not be renewed"
            self.order_kill(handle, KillReason.LOST_SESSION, None, error, release=True)
        else:
            why = "its channel closed" if handle.eof else "the supervisor was late"
            error = f"lease not renewed in time ({why})"
            self.order_kill(handle, KillReason.SILENT, ErrorKind.CRASHED, error)

    def still_silent(self, handle: WorkerHandle) -> bool:
        """Read what the worker sent before killing it for silence: after a stall of our own
        (a resumed freeze) its `done` may be waiting in its pipe."""
        lease = handle.lease
        self.read_channel(handle)
        return handle.lease is lease and lease is not None and self.clock() >= self.silent_at(lease)

    def silent_at(self, lease: HeldLease) -> float:
        """When a lease not renewed since is killed for: before it can lapse in the database."""
        trust = lease_trust(self.config.lease_ttl, self.config.heartbeat_interval)
        return self.renewed_at(lease) + trust

    def deadline_passed(self, handle: WorkerHandle, lease: HeldLease) -> None:
        # The run may have been paused and resumed since the lease (which moves its deadline),
        # so the database decides: fail overdue runs now, then kill whoever it revoked.
        lease.deadline_at = None
        try:
            failed = self.store.sweep_deadlines()
        except Exception as exc:
            log.warning("could not sweep deadlines: %s", one_line(exc))
            self.order_kill(handle, KillReason.DEADLINE, ErrorKind.DEADLINE, DEADLINE_ERROR)
            return
        self.events.runs_failed("deadline", failed)  # counted with the scanner's
        self.notified = True
        self.check_revocations()

    def order_kill(
        self,
        handle: WorkerHandle,
        reason: KillReason,
        record: ErrorKind | None,
        error: str,
        *,
        grace: float | None = None,
        release: bool = False,
    ) -> None:
        now = self.clock()
        grace = self.config.kill_grace if grace is None else grace
        if reason in NO_GRACE:
            grace = 0.0
        lease = handle.lease
        handle.kill = KillOrder(
            reason=reason, ordered_at=now, hard_at=now + grace, record=record, error=error,
            step_id=lease.step_id if lease else None, token=lease.token if lease else None,
            release=release,
        )  # fmt: skip
        self.kills[reason] = self.kills.get(reason, 0) + 1
        self.events.killed(reason)
        what = f" step {lease.step_id} ({lease.workflow}/{lease.node})" if lease else ""
        extra = step_extra(lease, "kill") if lease else {"action": "kill"}
        log.warning("killing %s%s: %s", handle.label, what, reason, extra=extra)
        if self.traces is not None and lease is not None:
            self.traces.killing(lease, reason, error, grace <= 0)
        if grace > 0:
            self.ops.signal(handle.pid, STOP_SIGNAL)
        else:
            self.hard_kill(handle)

    def hard_kill(self, handle: WorkerHandle) -> None:
        kill = handle.kill
        if kill is not None:
            # After a SIGTERM (an event of its own), the SIGKILL that follows kill_grace.
            graced = not kill.hard_sent and kill.hard_at > kill.ordered_at
            if graced and self.traces is not None and handle.lease is not None:
                self.traces.killing(handle.lease, kill.reason, "kill_grace passed", True)
            kill.hard_sent = True
        self.ops.signal_group(handle.pid, signal.SIGKILL)
        self.ops.signal(handle.pid, signal.SIGKILL)  # in case it never got its own group

    def kill_all(self, reason: KillReason) -> None:
        for handle in list(self.children.values()):
            if handle.kill is None:
                # A stop (or a restart) is planned, not the step's doing: its step goes back
                # with the attempt not spent, as operators.md promises.
                error = "worker killed at supervisor shutdown"
                self.order_kill(handle, reason, None, error, grace=0, release=True)
            elif not handle.kill.hard_sent:
                self.hard_kill(handle)

    # --- managing the count -------------------------------------------------------------------

    def workers(self) -> list[WorkerHandle]:
        return [h for h in self.children.values() if h.role is Role.WORKER]

    def busy(self) -> list[WorkerHandle]:
        return [h for h in self.workers() if h.lease is not None]

    def live(self) -> list[WorkerHandle]:
        """Children of the current generation that are not on their way out."""
        return [
            h
            for h in self.children.values()
            if h.generation == self.generation and not h.retiring and h.kill is None
        ]

    def missing(self) -> int:
        workers = sum(1 for h in self.live() if h.role is Role.WORKER)
        scanners = sum(1 for h in self.live() if h.role is Role.SCANNER)
        return max(0, self.target - workers) + (self.config.scanner and not scanners)

    def manage_workers(self) -> None:
        if self.halted or self.draining:
            return
        live_workers = [h for h in self.live() if h.role is Role.WORKER]
        # Too many (SIGTTOU): retire idle ones first, newest first.
        excess = len(live_workers) - self.target
        for handle in sorted(live_workers, key=lambda h: (h.busy, -h.number))[: max(excess, 0)]:
            self.retire(handle)
        if self.clock() < self.next_spawn_at:
            return
        if self.boot_failures and self.database_down:
            return  # they could only fail to boot: database_answered() spawns them
        # After a boot failure, probe with one child at a time until one boots (a probe
        # still booting counts: ticks come faster than children boot).
        if self.boot_failures and any(not h.booted for h in self.live()):
            return
        budget = 1 if self.boot_failures else self.missing()
        if self.config.scanner and not any(h.role is Role.SCANNER for h in self.live()):
            budget -= self.spawn(Role.SCANNER)
        taken = {h.number for h in self.live() if h.role is Role.WORKER}
        number = 1
        while budget > 0 and len(taken) < self.target:
            while number in taken:
                number += 1
            if not self.spawn(Role.WORKER, number):
                return
            taken.add(number)
            budget -= 1

    def spawn(self, role: Role, number: int = 0) -> bool:
        slot = None
        if role is Role.SCANNER:
            main = self.factory.scanner_main()
        else:
            slot = self.board.take() if self.board is not None else None
            if slot is None and self.board is not None:
                # Without one it never learns of a renewal: each step ends at its first trust.
                log.error("no renewal slot left for a new worker", extra={"action": "spawn"})
            main = self.factory.worker_main(number, slot)
        try:
            pid, fd = self.ops.spawn(main, close_fds=[h.fd for h in self.children.values()])
        except OSError as exc:
            log.error("fork failed: %s", exc, extra={"action": "spawn"})
            if self.board is not None:
                self.board.give_back(slot)
            self.next_spawn_at = self.clock() + BOOT_BACKOFF
            return False
        now = self.clock()
        handle = WorkerHandle(pid, role, number, self.generation, fd, now, now, slot=slot)
        self.children[pid] = handle
        self.watcher.watch(fd)
        log.info("spawned %s", handle.label, extra={"action": "spawn"})
        return True

    def retire(self, handle: WorkerHandle) -> None:
        """Ask a child to finish what it is doing and leave."""
        handle.retiring = True
        sig = RETIRE_SIGNAL if handle.role is Role.WORKER else STOP_SIGNAL
        self.ops.signal(handle.pid, sig)

    # --- stopping -----------------------------------------------------------------------------

    def begin_drain(self, why: str = "asked") -> None:
        self.draining = True
        self.drain_deadline = self.clock() + self.config.shutdown_timeout
        log.info(
            "%s: draining: %d busy workers get %.1fs", why, len(self.busy()),
            self.config.shutdown_timeout, extra={"action": "drain"},
        )  # fmt: skip
        for handle in self.children.values():
            if not handle.retiring and handle.kill is None:
                self.retire(handle)
        if not self.children:
            self.finished = True

    def halt(self) -> None:
        self.halted = True
        self.draining = True
        self.exit_code = EXIT_HALTED
        self.kill_all(KillReason.SHUTDOWN)
        if not self.children:
            self.finished = True

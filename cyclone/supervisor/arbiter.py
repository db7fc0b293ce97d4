"""The supervisor's decisions: who to spawn, who to kill and when, what to record, when to stop.

The arbiter owns no wait point and no clock of its own: the loop in `supervisor.py` feeds it
signals, pipe data and notifications, then calls `tick()`, which reaps, enforces deadlines and
manages the worker count (gunicorn's reap_workers / murder_workers / manage_workers). Every OS
call goes through `ProcessOps` and every database call through `Store`, so tests drive it with
a fake process layer and a fake clock.

Killing a worker is two-staged: SIGTERM asks it to stop cooperatively (its handler sees
`ctx.done`), and `kill_grace` later the whole process group gets SIGKILL, grandchildren
included. The step's outcome is written, fenced by the lease token, once the process is dead.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

from cyclone.errors import CycloneError
from cyclone.states import DEADLINE_ERROR, ErrorKind
from cyclone.supervisor import channel
from cyclone.supervisor.children import (
    RETIRE_SIGNAL,
    STOP_SIGNAL,
    ExitStatus,
    HeldLease,
    KillOrder,
    KillReason,
    ProcessOps,
    Role,
    WorkerHandle,
    held_lease,
)
from cyclone.supervisor.outcomes import RUN_ENDED, format_elapsed, log_outcome, step_label
from cyclone.supervisor.ports import (
    ArbiterConfig,
    ChildFactory,
    Events,
    NullEvents,
    NullWatcher,
    Reloader,
    Store,
    Watcher,
)

log = logging.getLogger(__name__)

# Respawn backoff after boot failures: doubling from BOOT_BACKOFF up to BOOT_BACKOFF_CAP, and
# a halt after MAX_BOOT_FAILURES in a row. Generous on purpose: the usual boot failure is a
# database restart, which takes seconds; a broken install fails the supervisor's own boot.
BOOT_BACKOFF = 0.5
BOOT_BACKOFF_CAP = 30.0
MAX_BOOT_FAILURES = 10
# A child that dies this soon after its fork, unasked, counts as a boot failure.
FAST_EXIT = 1.0
# After a database call failed, the next revocation poll waits this long: during an outage
# each attempt can block the loop for a connect timeout, and kills must stay on time.
DB_RETRY = 5.0
# With notifications working, polling for revoked leases is only a safety net.
LISTEN_POLL_FACTOR = 10
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
# A lease gone for none of those reasons (a sibling failed the run, or the run was deleted)
# may just as well have been ended by its own worker a moment ago, its report still on the
# way: with the CPU busy, the worker's commit and its pipe write can be tens of ms apart, and
# polling every poll_interval (behind a pooler, without notifications) met that window about
# once every hundred steps, killing a worker that was already on its next step. Such a
# revocation kills only when a second check, this much later, finds the lease still held.
REVOKE_SETTLE = 0.2


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
    ) -> None:
        self.config = config
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
        self.notifications = False
        self.notified = False
        self.unsettled: dict[int, str] = {}  # step id -> token: see REVOKE_SETTLE
        self.next_poll = 0.0
        self.draining = False
        self.drain_deadline: float | None = None
        self.halted = False
        self.finished = False
        self.exit_code = 0
        self.kills: dict[KillReason, int] = {}

    # --- inputs -------------------------------------------------------------------------------

    def handle_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name.lower().removeprefix("sig")
        handler = getattr(self, f"handle_{name}", None)
        if handler is not None:
            handler()

    def handle_term(self) -> None:
        if self.draining:
            log.warning("second stop signal: killing every child", extra={"action": "kill_all"})
            self.kill_all(KillReason.SHUTDOWN)
        else:
            self.begin_drain()

    handle_int = handle_term

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
        if self.reload is None or self.draining:
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
        self.manage_workers()

    def next_wakeup(self) -> float:
        """When tick() next has something to do, on the arbiter's clock."""
        now = self.clock()
        times = [now + MAX_TICK]
        kill_at = self.next_kill_at()
        if kill_at is not None:
            times.append(kill_at)
        if any(h.kill is None and h.lease is not None for h in self.children.values()):
            times.append(self.next_poll)  # a busy worker's lease may be revoked
        if not self.draining and self.missing() > 0:
            times.append(self.next_spawn_at)
        return max(now, min(times))

    def next_kill_at(self) -> float | None:
        """The earliest moment a kill may be due, on the arbiter's clock; None: none is.

        The loop's own database calls (presence) run only when this is far enough away, so
        that they can never hold a kill up. A silent worker's kill is left out: it is a
        backstop on the scale of a whole lease, and a busy worker is always close to it.
        """
        times: list[float] = []
        for handle in self.children.values():
            if handle.kill is not None:
                # Killed: only the SIGKILL is still to come; then we wait for SIGCHLD.
                if not handle.kill.hard_sent:
                    times.append(handle.kill.hard_at)
            elif handle.lease is not None:
                times += [t for t in (handle.lease.timeout_at, handle.lease.deadline_at) if t]
        if self.drain_deadline is not None:
            times.append(self.drain_deadline)
        return min(times, default=None)

    # --- reading channels ---------------------------------------------------------------------

    def read_channel(self, handle: WorkerHandle) -> None:
        while True:
            data = self.ops.read(handle.fd)
            if data == b"":
                # End of file before the exit is reaped (or a grandchild still holds the
                # pipe): stop watching, or the selector reports the fd readable forever.
                self.watcher.unwatch(handle.fd)
            if not data:
                return
            for line in handle.buffer.feed(data):
                try:
                    message = channel.decode(line)
                except channel.ProtocolError as exc:
                    log.warning("%s sent a bad line: %s", handle.label, exc)
                    continue
                self.on_message(handle, message)

    def on_message(self, handle: WorkerHandle, message: channel.Message) -> None:
        now = self.clock()
        handle.last_seen = now
        if isinstance(message, channel.Ready):
            handle.booted = True
            self.boot_failures = 0
        elif isinstance(message, channel.Leased):
            handle.lease = held_lease(message, now)
            self.events.leased(handle.lease)
        elif isinstance(message, channel.Done):
            if handle.lease is not None and handle.lease.step_id == message.step_id:
                self.events.finished(handle.lease, message.outcome, message.duration)
                log_outcome(handle.lease, message)
                handle.lease = None
            handle.steps += 1
        elif isinstance(message, channel.Idle):
            handle.lease = None
        elif isinstance(message, channel.Scanned):
            self.events.scanned(message)

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
        if kill is not None and lease is not None and kill.step_id == lease.step_id:
            if kill.record is not None and kill.token is not None:
                self.record(lease, kill.record, kill.error)
            else:
                # The database revoked the lease and already holds the outcome.
                log.info(
                    "%s killed after %s (%s)%s", step_label(lease),
                    format_elapsed(self.clock() - lease.leased_at), kill.reason,
                    RUN_ENDED.get(kill.reason, ""), extra={"action": "record"},
                )  # fmt: skip
        elif lease is not None:
            # Died on its own mid-step (or mid a step leased after the one we killed it for).
            self.record(lease, ErrorKind.CRASHED, f"worker process {status.describe()}")
        unasked = kill is None and not handle.retiring and not self.draining
        if unasked and self.failed_to_boot(handle, status):
            self.boot_failed(handle)

    def failed_to_boot(self, handle: WorkerHandle, status: ExitStatus) -> bool:
        if not handle.booted or status.code == channel.ExitCode.BOOT_ERROR:
            return True
        # A child that crashes right after booting (its database lacks the schema, say)
        # would otherwise be respawned as fast as we can fork.
        expected = status.code in (channel.ExitCode.OK, channel.ExitCode.RECYCLE)
        return not expected and self.clock() - handle.spawned_at < FAST_EXIT

    def boot_failed(self, handle: WorkerHandle) -> None:
        self.boot_failures += 1
        if self.boot_failures >= MAX_BOOT_FAILURES:
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
            log.error("could not record step %d as %s: %s", lease.step_id, kind, exc)
            return
        if written:
            elapsed = self.clock() - lease.leased_at
            self.events.finished(lease, str(kind), elapsed)
            log.info(
                "%s recorded as %s after %s: %s", step_label(lease), kind, format_elapsed(elapsed),
                error, extra={"action": "record"},
            )  # fmt: skip

    # --- killing ------------------------------------------------------------------------------

    def check_revocations(self) -> None:
        """Kill workers whose lease the database revoked (run cancelled, failed, overdue)."""
        held = {h.lease.step_id: h.lease.token for h in self.busy() if h.kill is None}
        now = self.clock()
        if not held or not (self.notified or now >= self.next_poll):
            return
        self.notified = False
        factor = LISTEN_POLL_FACTOR if self.notifications else 1
        self.next_poll = now + self.config.poll_interval * factor
        try:
            revoked = self.store.revoked(held)
        except Exception as exc:
            log.warning("could not check for revoked leases: %s", exc)
            self.next_poll = now + DB_RETRY
            return
        unsettled, self.unsettled = self.unsettled, {}
        for handle in self.busy():
            lease = handle.lease
            if lease is None or lease.step_id not in revoked or handle.kill is not None:
                continue
            self.read_channel(handle)  # it may have finished the step a moment ago
            if handle.lease is not lease:
                continue
            reason = REVOKE_REASONS.get(revoked[lease.step_id] or "")
            if reason is None and unsettled.get(lease.step_id) != lease.token:
                self.unsettled[lease.step_id] = lease.token
                continue
            self.order_kill(handle, reason or KillReason.CANCEL, record=None, error="lease revoked")
        if self.unsettled:
            self.next_poll = min(self.next_poll, now + REVOKE_SETTLE)

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
            elif lease is not None and now - handle.last_seen > self.config.lease_ttl:
                error = "worker stopped heartbeating"
                self.order_kill(handle, KillReason.SILENT, ErrorKind.CRASHED, error)
        if self.drain_deadline is not None and now >= self.drain_deadline:
            self.drain_deadline = None
            log.warning("shutdown_timeout passed: killing", extra={"action": "kill_all"})
            self.kill_all(KillReason.SHUTDOWN)

    def deadline_passed(self, handle: WorkerHandle, lease: HeldLease) -> None:
        # The run may have been paused and resumed since the lease (which moves its deadline),
        # so the database decides: fail overdue runs now, then kill whoever it revoked.
        lease.deadline_at = None
        try:
            failed = self.store.sweep_deadlines()
        except Exception as exc:
            log.warning("could not sweep deadlines: %s", exc)
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
    ) -> None:
        now = self.clock()
        grace = self.config.kill_grace if grace is None else grace
        lease = handle.lease
        handle.kill = KillOrder(
            reason=reason, ordered_at=now, hard_at=now + grace, record=record, error=error,
            step_id=lease.step_id if lease else None, token=lease.token if lease else None,
        )  # fmt: skip
        self.kills[reason] = self.kills.get(reason, 0) + 1
        self.events.killed(reason)
        what = f" step {lease.step_id} ({lease.workflow}/{lease.node})" if lease else ""
        log.warning("killing %s%s: %s", handle.label, what, reason, extra={"action": "kill"})
        if grace > 0:
            self.ops.signal(handle.pid, STOP_SIGNAL)
        else:
            self.hard_kill(handle)

    def hard_kill(self, handle: WorkerHandle) -> None:
        if handle.kill is not None:
            handle.kill.hard_sent = True
        self.ops.signal_group(handle.pid, signal.SIGKILL)
        self.ops.signal(handle.pid, signal.SIGKILL)  # in case it never got its own group

    def kill_all(self, reason: KillReason) -> None:
        for handle in list(self.children.values()):
            if handle.kill is None:
                record = ErrorKind.CRASHED if handle.lease else None
                error = "worker killed at supervisor shutdown"
                self.order_kill(handle, reason, record, error, grace=0)
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
        # After a boot failure, probe with one child at a time until one boots.
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
        main = (
            self.factory.scanner_main()
            if role is Role.SCANNER
            else self.factory.worker_main(number)
        )
        try:
            pid, fd = self.ops.spawn(main, close_fds=[h.fd for h in self.children.values()])
        except OSError as exc:
            log.error("fork failed: %s", exc, extra={"action": "spawn"})
            self.next_spawn_at = self.clock() + BOOT_BACKOFF
            return False
        now = self.clock()
        handle = WorkerHandle(pid, role, number, self.generation, fd, now, now)
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

    def begin_drain(self) -> None:
        self.draining = True
        self.drain_deadline = self.clock() + self.config.shutdown_timeout
        log.info(
            "draining: %d busy workers get %.1fs", len(self.busy()), self.config.shutdown_timeout,
            extra={"action": "drain"},
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

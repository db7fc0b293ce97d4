"""The supervisor's loop: one thread, one wait point, signal handlers that only record.

The wait point is a selector on the self-pipe that `signal.set_wakeup_fd` feeds, on every
child's pipe and on the LISTEN connection. After each wake-up the loop hands the recorded
signals, pipe data and notifications to the arbiter and lets it tick. The loop is the only
thread that changes anything: the others serve `/metrics` (metrics.py), since a client there
must never hold up a kill. A fork copies only the thread that calls it, so those threads touch
nothing a child uses (the registry, their sockets, the gauges' session; logging's locks are
made anew in a child, and they log only at debug level).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from cyclone.child.lease import RenewalBoard
from cyclone.child.proctitle import set_title, supervisor_title
from cyclone.child.session import connect_briefly
from cyclone.config import Settings, load_config
from cyclone.engine.versions import Served
from cyclone.errors import ConfigError
from cyclone.notify import Notifier
from cyclone.outage import OutageLog
from cyclone.scanner import Scanner, ScannerOptions
from cyclone.supervisor.arbiter import Arbiter, ArbiterConfig
from cyclone.supervisor.children import Role
from cyclone.supervisor.dispatch import Dispatcher
from cyclone.supervisor.metrics import Metrics, MetricsServer
from cyclone.supervisor.ports import Traces
from cyclone.supervisor.presence import MIN_GAP, Presence, snapshot
from cyclone.supervisor.processes import SUPERVISOR_SIGNALS, ChildMain, OsProcessOps
from cyclone.supervisor.renewal import Renewer
from cyclone.supervisor.served import (
    RELOAD_APPLIES,
    RELOAD_KEEPS,
    describe_reload,
    leasing_alone,
    serving,
    warn_unserved,
)
from cyclone.supervisor.store import DatabaseStore, Listener
from cyclone.worker import Worker, WorkerOptions
from cyclone.workflow import Registry

log = logging.getLogger(__name__)
# The longest a tick waits while only worker messages arrive (see Supervisor.wait).
TICK_EVERY = 0.1
# After a wake-up that brought worker messages, let the next ones pile up this long before
# looking again (never past a due timer): busy workers then cost one wake-up per batch,
# not one per step. A signal or notification waits at most this long too.
COALESCE = 0.005
# The same with dispatch on, while the workers run the leases queued for them and wait for
# nothing (Dispatcher.only_taken): shorter, as a worker whose queue ran dry waits for it.
TAKEN_COALESCE = 0.002

# A broken LISTEN connection is re-opened at most this often; polling covers the gap.
LISTEN_RETRY = 5.0
# Without dispatch: how long idle workers nudged awake get to find a step before the flag is
# set for them again (each nudge costs each a lease statement).
OWN_SETTLE = 0.02
# The database gauges of /metrics are read inside the loop: their query gets less time than
# the supervisor's writes do.
METRICS_STATEMENT_TIMEOUT_MS = 1000
# Runs that no live VM serves (a version retired with runs in flight) are looked for this often.
UNSERVED_CHECK_EVERY = 30.0
# A presence upsert touches a handful of rows; it must never hold the loop long.
PRESENCE_STATEMENT_TIMEOUT_MS = 500

_WAKEUP, _LISTENER, _CHILD = "wakeup", "listener", "child"
_DISPATCH = "dispatch"
_RENEW = "renew"
# The exit status of a start-up that a setting makes impossible (as for a bad config file):
# systemd's RestartPreventExitStatus=2 keeps it from restarting in a loop.
EXIT_CONFIG = 2


def arbiter_config(settings: Settings) -> ArbiterConfig:
    return ArbiterConfig(
        workers=settings.supervisor.workers,
        kill_grace=settings.supervisor.kill_grace,
        shutdown_timeout=settings.supervisor.shutdown_timeout,
        lease_ttl=settings.worker.lease_ttl,
        poll_interval=settings.worker.poll_interval,
        scanner=settings.scanner.enabled,
        heartbeat_interval=settings.worker.heartbeat_interval,
    )


def dispatching(settings: Settings) -> bool:
    """Whether the supervisor leases for its workers (supervisor/dispatch.py). Not without
    prepared statements (behind a transaction pooler): its statement, planned anew at every
    call, would cost more than it saves."""
    return settings.supervisor.dispatch and settings.database.prepared_statements


@dataclass(frozen=True)
class ChildBuilder:
    """Builds each child's object in the supervisor, before the fork (gunicorn's contract)."""

    settings: Settings
    dsn: str
    registry: Registry
    board: RenewalBoard | None = None

    def worker_main(self, number: int, slot: int | None = None) -> ChildMain:
        options = WorkerOptions(
            number=number,
            dsn=self.dsn,
            lease_ttl=self.settings.worker.lease_ttl,
            heartbeat_interval=self.settings.worker.heartbeat_interval,
            poll_interval=self.settings.worker.poll_interval,
            max_steps=self.settings.supervisor.max_steps_per_worker,
            dispatch=dispatching(self.settings),
            max_memory=self.settings.worker.max_memory,
            own_workflows=leasing_alone(self.registry, self.settings),
        )
        return Worker(options, self.registry, os.getpid(), self.board, slot).run

    def scanner_main(self) -> ChildMain:
        options = ScannerOptions(
            dsn=self.dsn,
            interval=self.settings.scanner.interval,
            batch_size=self.settings.scanner.batch_size,
            retention=self.settings.scanner.retention,
            history_after=self.settings.scanner.history_after,
            archive_dir=self.settings.scanner.archive_dir,
            archive_command=self.settings.scanner.archive_command,
            lease_ttl=self.settings.worker.lease_ttl,
            # Not through a transaction pooler: its LISTEN would sit on a borrowed session.
            wake=self.settings.supervisor.wake and (
                self.settings.database.prepared_statements
                or self.settings.database.listen_url is not None
            ),
            listen_dsn=self.settings.database.listen_url,
        )
        return Scanner(options, parent=os.getpid()).run


class Supervisor:
    @staticmethod
    def _metrics(dsn: str, read_url: str | None) -> Metrics:
        """The metrics, their database gauges read on the read replica when there is one."""

        def primary() -> psycopg.Connection[Any]:
            return connect_briefly(dsn, METRICS_STATEMENT_TIMEOUT_MS)

        if read_url is None:
            return Metrics(primary)
        return Metrics(lambda: connect_briefly(read_url, METRICS_STATEMENT_TIMEOUT_MS), primary)

    def __init__(
        self,
        settings: Settings,
        *,
        dsn: str,
        registry: Registry,
        config_path: str | None = None,
        load_workflows: Callable[[Settings], Registry] | None = None,
    ) -> None:
        self.settings = settings
        self.dsn = dsn
        self.loaded = registry  # every workflow imported; `registry`: those of served queues
        self.registry = serving(registry, settings)
        self.config_path = config_path
        self.load_workflows = load_workflows
        self.pending_signals: list[int] = []
        self.last_tick = 0.0
        self.coalesce_until = 0.0
        # Without dispatch, the workers lease on their own: whether the flag is set for them,
        # and when they were last nudged (see arm_own).
        self.own_armed = False
        self.nudged_at = 0.0
        self.selector = selectors.DefaultSelector()
        # Notifications need a session of their own on the server itself, not a pooler's.
        self.listener = Listener(settings.database.listen_url or dsn)
        self.listen_outage = OutageLog(log, "LISTEN for revocations (polling meanwhile)")
        self.next_listen_at = 0.0
        self.metrics = self._metrics(dsn, settings.database.read_url)
        self.metrics_server: MetricsServer | None = None
        self.presence = Presence(lambda: connect_briefly(dsn, PRESENCE_STATEMENT_TIMEOUT_MS))
        self.notifier = Notifier()
        self.started_at = time.monotonic()
        self.served = Served(self.registry)
        # Versions whose runs no VM serves, named in the log once each (warn_unserved).
        self.unserved_told: set[tuple[str, str]] = set()
        self.unserved_checked = 0.0
        self.dispatcher = Dispatcher(
            dsn, workflows=lambda: tuple(self.registry), lease_ttl=settings.worker.lease_ttl,
            graphs=lambda: self.served.graphs, limited=lambda: self.served.limited,
            watch=lambda fd: self.watch_session(fd, _DISPATCH),
            unwatch=self.unwatch_session, observe=self.metrics.dispatched,
            caps=lambda: self.settings.supervisor.caps(), queue_of=self.queue_of,
            poll=settings.worker.poll_interval,
            listening=lambda: self.settings.supervisor.wake and self.listener.working,
        )  # fmt: skip
        # Made before any fork, so that every worker shares it (child/lease.py).
        self.board = RenewalBoard()
        self.renewer = Renewer(
            dsn, lease_ttl=settings.worker.lease_ttl,
            watch=lambda fd: self.watch_session(fd, _RENEW),
            unwatch=self.unwatch_session,
        )  # fmt: skip
        self.listener_fd = -1  # watch_session's descriptor for the LISTEN session

    def queue_of(self, workflow: str) -> str:
        return self.loaded[workflow].queue if workflow in self.loaded else "default"

    # --- the selector, as the arbiter's Watcher ----------------------------------------------

    def watch(self, fd: int) -> None:
        self.selector.register(fd, selectors.EVENT_READ, _CHILD)

    def unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)

    def watch_session(self, fd: int, data: str) -> int:
        """Watch a database session's socket through a descriptor of our own; return it.

        libpq closes its socket as soon as it finds the connection broken, before the loop can
        stop watching it, and every worker forked meanwhile holds the socket too, so it stays
        open: epoll went on reporting it, hung up, under its number, which by then named
        another channel (a new worker's), and the loop spun on reads of that one (bench/chaos.py
        after a PostgreSQL restart). Our own descriptor is closed only after it is unwatched.
        """
        own = os.dup(fd)
        self.selector.register(own, selectors.EVENT_READ, data)
        return own

    def drop_listener(self) -> None:
        self.unwatch_session(self.listener_fd)
        self.listener_fd = -1
        self.listener.close()

    def unwatch_session(self, own: int) -> None:
        if own < 0:
            return
        self.unwatch(own)
        with contextlib.suppress(OSError):
            os.close(own)

    # --- running ------------------------------------------------------------------------------

    def run(self) -> int:
        set_title(supervisor_title())
        try:
            # Before any child or signal handler: READY=1 promises that /metrics is served.
            self.serve_metrics()
        except ConfigError as exc:
            log.critical("%s", exc, extra={"action": "start"})
            return EXIT_CONFIG
        ops = OsProcessOps()
        ops.private_fds = self.install_signals()
        ops.adopt_orphans()  # a handler's daemon dies with its worker (child/reaper.py)
        store = self.store = DatabaseStore(self.dsn, self.settings.scanner.batch_size)
        try:
            traces = self.start_tracing()
        except ConfigError as exc:
            log.critical("%s", exc, extra={"action": "start"})
            return EXIT_CONFIG
        self.arbiter = Arbiter(
            arbiter_config(self.settings), ops=ops, clock=time.monotonic, store=store,
            factory=ChildBuilder(self.settings, self.dsn, self.registry, self.board),
            reload=self.reload if self.config_path else None, watcher=self, events=self.metrics,
            wants=self.dispatcher.want, renewer=self.renewer, board=self.board, traces=traces,
            give_back=self.dispatcher.release_later, revoke_queued=self.dispatcher.revoked,
        )  # fmt: skip
        self.metrics.watch(self.arbiter.children)
        self.ensure_listener()
        log.info("supervisor %d started", os.getpid(), extra={"action": "start"})
        self.refresh_graphs()
        self.warn_unserved()
        self.arbiter.start()
        # Config, database and schema were checked before we got here, the metrics socket is
        # bound and the children are forked: now systemd may consider us started.
        self.notifier.ready(self.status_line())
        try:
            while not self.arbiter.finished:
                # A wake-up that only brought worker messages (a lease taken, a step done)
                # changes no timer that is already due: the tick waits for one that is, for
                # a signal, or for a child's exit, so busy workers do not make the loop spin.
                if self.wait():
                    self.arbiter.tick()
                    self.after_tick()
        finally:
            self.presence.withdraw()
            self.listener.close()
            self.dispatcher.close()
            self.renewer.close()
            store.close()
            if traces is not None:
                traces.close()  # the spans still open end here, and all are exported
            if self.metrics_server is not None:
                self.metrics_server.close()
            signal.set_wakeup_fd(-1)
        log.info("supervisor %d stopped", os.getpid(), extra={"action": "stop"})
        return self.arbiter.exit_code

    def start_tracing(self) -> Traces | None:
        """The attempts' spans, when [tracing] is on: OpenTelemetry is imported only then."""
        if not self.settings.tracing.enabled:
            return None
        from cyclone.supervisor.tracing import AttemptTraces

        log.info("tracing: a span per attempt, exported over OTLP", extra={"action": "start"})
        return AttemptTraces(self.dsn)

    def install_signals(self) -> list[int]:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self.selector.register(read_fd, selectors.EVENT_READ, _WAKEUP)
        self.wakeup_fd = read_fd
        for sig in SUPERVISOR_SIGNALS:
            signal.signal(sig, self.record_signal)
        return [read_fd, write_fd]

    def record_signal(self, signum: int, frame: object) -> None:
        # No logging, no I/O, no decisions here: gunicorn learned that from deadlocks.
        self.pending_signals.append(signum)

    def wait(self) -> bool:
        """Wait for the next event; True when the tick has work (a timer, signal or exit)."""
        now = time.monotonic()
        wake = min(self.arbiter.next_wakeup(), max(self.presence.next_at(), now + MIN_GAP))
        linger = self.dispatcher.next_at()
        if linger is not None:
            wake = min(wake, linger)
        kept = self.listener.wake_at()  # a notification kept back by the debounce
        if kept is not None:
            wake = min(wake, kept)
        if self.arm_due():
            wake = min(wake, self.nudged_at + OWN_SETTLE)
        if self.coalesce_until > now:
            time.sleep(max(0.0, min(self.coalesce_until, wake) - now))
            now = time.monotonic()
        tick = False
        for key, _ in self.selector.select(max(0.0, wake - now)):
            if key.data == _WAKEUP:
                self.drain_wakeup()
                self.presence.mark_changed()  # most likely SIGCHLD: a child came or went
                tick = True
            elif key.data == _LISTENER:
                tick = self.read_listener() or tick
            elif key.data == _DISPATCH:
                self.dispatcher.on_readable(key.fd, self.arbiter)  # type: ignore[arg-type]
            elif key.data == _RENEW:
                self.renewer.on_readable(self.arbiter)
                tick = True  # a lease found revoked is checked (and its worker killed) now
            else:
                self.arbiter.on_readable(key.fd)  # type: ignore[arg-type]
                self.presence.mark_changed()
                if not dispatching(self.settings):
                    # Workers that lease for themselves only report: their lines may wait.
                    self.coalesce_until = time.monotonic() + COALESCE
        if self.listener.due():
            self.arbiter.on_notify()
            tick = True
        if self.listener.take_ready():
            self.dispatcher.wake()
            self.own_armed = False
            self.nudge_idle()
        elif not dispatching(self.settings):
            self.arm_own()
        # Workers that wait for their next step wait for this: answered before anything else.
        self.dispatcher.flush(self.arbiter)
        if self.dispatcher.only_taken():
            # Workers busy with their queued leases: their next lines may wait a moment, and
            # the loop wakes once for several (never past a due timer: see above).
            self.coalesce_until = time.monotonic() + TAKEN_COALESCE
        signals, self.pending_signals = self.pending_signals, []
        for signum in signals:
            self.arbiter.handle_signal(signum)
        if not self.listener.healthy:
            self.ensure_listener()
        now = time.monotonic()
        # Some wake times move with the clock (the idle tick, presence): a steady stream of
        # messages would push them back forever, so the tick also runs every TICK_EVERY.
        if tick or signals or now >= wake or now - self.last_tick >= TICK_EVERY:
            self.last_tick = now
            return True
        return False

    def after_tick(self) -> None:
        """Tell systemd and the database what changed, when no kill can be held up by it."""
        if self.arbiter.draining:
            self.notifier.stopping("draining: " + self.status_line())
        now = time.monotonic()
        if self.arbiter.finished or not self.presence.due(now, self.arbiter.next_kill_at()):
            return
        if self.served.due() and self.presence.session.alive:
            self.refresh_graphs(self.presence.session.get)
        if now - self.unserved_checked >= UNSERVED_CHECK_EVERY and self.presence.session.alive:
            # A version whose last VM was retired since: said once, when first seen. On the
            # kept session (its short statement timeout): the loop must not wait on a connect.
            self.warn_unserved(lambda: contextlib.nullcontext(self.presence.session.get()))
        snap = snapshot(
            self.arbiter.children.values(), draining=self.arbiter.draining,
            target=self.arbiter.target, uptime=now - self.started_at, now=now,
            workflows=self.registry, graphs=self.served.graphs,
        )  # fmt: skip
        if self.presence.publish(snap, now):
            # Its publishes are the loop's own regular database calls: they tell when the
            # database answers again, even with no scanner and every worker gone.
            self.arbiter.database_answered()
        else:
            self.arbiter.database_failed()
        self.notifier.update(self.status_line())

    def refresh_graphs(self, kept: Callable[[], psycopg.Connection[Any]] | None = None) -> None:
        """Look again at which graph versions our code can run (engine/versions.py), on the
        presence session `kept` (else a brief connection); on an error, keep what we had."""
        before = set(self.served.graphs)
        try:
            if kept is not None:
                self.served.refresh(kept())
            else:
                with connect_briefly(self.dsn, PRESENCE_STATEMENT_TIMEOUT_MS) as conn:
                    self.served.refresh(conn)
        except psycopg.Error as exc:
            log.warning("cannot look up graph versions: %s", exc, extra={"action": "versions"})
            return
        added = [g for g in self.served.graphs if g not in before]
        if added and self.presence.published:
            log.info("now serving graph versions: %s", ", ".join(g[:12] for g in added),
                     extra={"action": "versions"})  # fmt: skip

    def status_line(self) -> str:
        workers = self.arbiter.workers()
        busy = sum(1 for h in workers if h.busy)
        return f"{busy} busy, {len(workers) - busy} idle workers (target {self.arbiter.target})"

    def drain_wakeup(self) -> None:
        try:
            while os.read(self.wakeup_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def serve_metrics(self) -> None:
        config = self.settings.metrics
        if not config.enabled:
            return
        try:
            self.metrics_server = MetricsServer(self.metrics, config.bind, config.port)
        except OSError as exc:
            # Running without them would report ready with a promised part missing, and
            # alerts on cyclone_* metrics would read the silence as "no problems".
            raise ConfigError(
                f"[metrics] cannot serve on {config.bind}:{config.port}: "
                f"{exc.strerror or exc}: choose another [metrics] port (0 picks a free one) "
                "or bind, or set [metrics] enabled = false"
            ) from None

    # --- notifications ------------------------------------------------------------------------

    def ensure_listener(self) -> None:
        now = time.monotonic()
        if now < self.next_listen_at:
            return
        self.next_listen_at = now + LISTEN_RETRY
        if self.listener.conn is not None:
            self.drop_listener()
        try:
            working = self.listener.open()
        except psycopg.Error as exc:
            # Retried every LISTEN_RETRY: said once per outage, polling meanwhile.
            self.listen_outage.failed(exc)
            self.listener.close()
            working = False
        else:
            self.listen_outage.succeeded()
            if self.listener.conn is not None:  # None: notifications never arrived, polling
                self.listener_fd = self.watch_session(self.listener.fileno(), _LISTENER)
        self.arbiter.set_notifications(working)

    def idle_workers(self) -> list[Any]:
        return [
            h for h in self.arbiter.children.values()
            if h.role is Role.WORKER and h.booted and h.lease is None and h.kill is None
            and not h.retiring and not h.eof
        ]  # fmt: skip

    def nudge_idle(self) -> None:
        """Without dispatch: wake the idle workers, which lease on their own. SIGCONT: their
        keeper thread sees every signal and wakes the idle main thread; a worker holding no
        lease does nothing else on it (one that just took one, unknown to us yet, neither)."""
        if dispatching(self.settings):
            return
        self.nudged_at = time.monotonic()
        for handle in self.idle_workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, signal.SIGCONT)

    def arm_due(self) -> bool:
        """Without dispatch: whether the flag is to be set for idle workers (see arm_own)."""
        return (
            not dispatching(self.settings) and not self.own_armed
            and self.settings.supervisor.wake and self.listener.working
            and bool(self.idle_workers())
        )  # fmt: skip

    def arm_own(self) -> None:
        """Without dispatch: once idle workers stayed idle a moment after a nudge, set the flag,
        then nudge them once more (a step made ready before the flag was set notified nobody:
        that look finds it)."""
        if not self.arm_due() or time.monotonic() - self.nudged_at < OWN_SETTLE:
            return
        try:
            self.store.arm_wake()
        except psycopg.Error as exc:
            log.debug("cannot set the wake flag: %s", exc)
            self.nudged_at = time.monotonic()  # tried again after OWN_SETTLE
            return
        self.own_armed = True
        self.nudge_idle()

    def read_listener(self) -> bool:
        """Whether the tick has work: a revocation check due, or notifications lost."""
        try:
            if self.listener.drain():
                self.arbiter.on_notify()
                return True
        except psycopg.Error as exc:
            log.warning("LISTEN connection lost: %s", exc)
            self.drop_listener()
            self.arbiter.set_notifications(False)
            return True
        return False  # nothing, or a notification the debounce keeps for later

    # --- reload -------------------------------------------------------------------------------

    def reload(self) -> tuple[ArbiterConfig, Any]:
        """SIGHUP: read the config again; the arbiter replaces the children with the result."""
        settings = load_config(self.config_path)
        log.info(RELOAD_APPLIES, extra={"action": "reload"})
        log.info(RELOAD_KEEPS, extra={"action": "reload"})
        for warning in describe_reload(self.settings, settings):
            log.warning(warning, extra={"action": "reload"})
        if settings.workflows.modules != self.settings.workflows.modules and self.load_workflows:
            # New modules are imported (and registered) here, before any fork; modules
            # already imported keep their code until a restart.
            try:
                self.loaded = self.load_workflows(settings)
            except (ImportError, psycopg.Error) as exc:
                raise ConfigError(f"[workflows] modules: {exc}") from exc
        self.registry = serving(self.loaded, settings)
        self.served = Served(self.registry)
        self.refresh_graphs()
        self.settings = settings
        self.dispatcher.lease_ttl = settings.worker.lease_ttl
        self.dispatcher.poll = settings.worker.poll_interval
        self.renewer.lease_ttl = settings.worker.lease_ttl
        log.info("workers will serve: %s", ", ".join(sorted(self.registry)) or "no workflow")
        self.warn_unserved()
        return arbiter_config(settings), ChildBuilder(settings, self.dsn, self.registry, self.board)

    def warn_unserved(self, connect: Callable[[], Any] | None = None) -> None:
        """Name the workflows (and versions) whose running runs no worker (ours or another
        live supervisor's) serves: they would wait silently. Each version once (until it is
        served again)."""
        warn_unserved(connect or (lambda: connect_briefly(self.dsn)), self.registry,
                      self.presence.id, self.served.graphs, self.unserved_told)  # fmt: skip
        self.unserved_checked = time.monotonic()

"""The scanner process: run every sweep, pause `scanner.interval`, repeat, until told to stop.

Between passes it wakes for timers (migration 22): before it sleeps it writes the next time
due within its pause (a retry's backoff, a sleep, a max_wait, a deadline, a schedule's tick;
cyclone_next_due), sleeps until then, and LISTENs on cyclone_timer for a time set earlier
meanwhile. Woken for a time, it runs the sweeps that act on times (`Sweep.timely`) and wakes a
supervisor that waits for work (a retry came due), then sleeps again; the full pass still
runs every interval.
"""

from __future__ import annotations

import logging
import random
import select
import signal
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from cyclone.child import channel
from cyclone.child.channel import Channel, ExitCode
from cyclone.child.process import (
    CONNECT_TIMEOUT,
    ChildExit,
    Wakeup,
    check_parent,
    init_process,
)
from cyclone.child.proctitle import scanner_title, set_title
from cyclone.child.session import connect_briefly
from cyclone.db import HOT_PLANS, with_options
from cyclone.engine.sweeps import enabled_sweeps
from cyclone.outage import OutageLog
from cyclone.scanner.base import Sweeper
from cyclone.sql import QUERIES
from cyclone.states import WAKE_SETTLE

log = logging.getLogger(__name__)

# Scanners started together (a fleet rebooted at once) spread out over this first pause.
START_STAGGER = 1.0
# Each pause is the interval give or take this share, so scanners on many hosts drift apart.
INTERVAL_JITTER = 0.1
# Wakes for timers are at least this far apart: a stream of timers is handled in batches.
TIMER_GAP = 0.005
# The furthest ahead a sleep looks: the triggers notify only for times within a minute (0022).
HORIZON = 60.0
LISTEN = "LISTEN cyclone_timer"


@dataclass(frozen=True, slots=True)
class ScannerOptions:
    dsn: str
    interval: float
    batch_size: int
    retention: float  # seconds; 0 or less keeps finished runs forever
    # Seconds after their end that finished runs move to history; 0 or less: they stay hot.
    history_after: float = 0.0
    # Where history goes before retention drops it (cyclone/engine/archive.py); None: nowhere.
    archive_dir: str | None = None
    archive_command: str | None = None
    # No statement may hold its locks longer than this: a stuck sweep fails and runs again.
    statement_timeout: float = 30.0
    # The workers' lease_ttl: a lease that lapsed before the server had been up this long
    # lapsed because the database was down, and spends no attempt (sweep_expired_leases).
    lease_ttl: float | None = None
    # Wake for timers between passes ([supervisor] wake; not through a transaction pooler).
    wake: bool = False
    # Where to LISTEN when not on the sweeps' session ([database] listen_url).
    listen_dsn: str | None = None


def make_sweeps(options: ScannerOptions) -> list[Sweeper]:
    """The registry's sweeps (`cyclone.engine.sweeps.SWEEPS`) that these options enable, in
    its order: a retention of 0 or less keeps finished runs forever."""
    settings: dict[str, Any] = {
        "retention": options.retention, "history_after": options.history_after,
        "archive_dir": options.archive_dir, "archive_command": options.archive_command,
    }  # fmt: skip
    if options.lease_ttl is not None:
        settings["outage_grace"] = options.lease_ttl
    return [
        Sweeper(sweep, batch_size=options.batch_size, settings=settings)
        for sweep in enabled_sweeps(settings)
    ]


class Scanner:
    """Built in the supervisor before the fork; `run` is the child's main after it."""

    def __init__(self, options: ScannerOptions, parent: int) -> None:
        self.options = options
        self.parent = parent
        self.sweeps = make_sweeps(options)
        self.stop_requested = False
        self.conn: psycopg.Connection[Any] | None = None
        self.listening: psycopg.Connection[Any] | None = None  # the session that LISTENs
        self.since: Any = None  # the database's time as the last pass began
        self.outage = OutageLog(log, "scanner")

    def run(self, fd: int) -> int:
        try:
            init_process(self.parent)
            self.wakeup = Wakeup()
            signal.signal(signal.SIGTERM, self._on_stop)
            signal.signal(signal.SIGUSR1, self._on_stop)
            set_title(scanner_title())
            try:
                self.conn = self.connect()
            except psycopg.Error as exc:
                log.error("scanner cannot connect: %s", exc)
                return ExitCode.BOOT_ERROR
            self.channel = Channel(fd)
            self.channel.send(channel.Ready())
            self.wakeup.wait(random.uniform(0, min(START_STAGGER, self.options.interval)))
            return self.loop()
        except ChildExit as exc:
            return exc.code
        except ConnectionError:  # broken pipe or reset: the supervisor is gone
            return ExitCode.ORPHANED

    def _on_stop(self, signum: int, frame: object) -> None:
        self.stop_requested = True  # only record: the loop acts on it

    def connect(self) -> psycopg.Connection[Any]:
        return connect_briefly(
            with_options(self.options.dsn, HOT_PLANS), int(self.options.statement_timeout * 1000),
            name="cyclone-scanner",
            connect_timeout=CONNECT_TIMEOUT,
        )  # fmt: skip

    def loop(self) -> int:
        timely = False
        while not self.stop_requested:
            check_parent(self.parent)
            counts, ok = self.scan_once(timely_only=timely)
            # Every pass is reported, quiet ones too: the supervisor's metrics show the
            # scanner's last pass, and the rows each sweep changed.
            if not timely or any(counts.values()):
                self.channel.send(channel.Scanned(at=time.time(), ok=ok, counts=counts))
            if not timely:
                jitter = random.uniform(1 - INTERVAL_JITTER, 1 + INTERVAL_JITTER)
                next_pass = time.monotonic() + self.options.interval * jitter
            timely = self.sleep(next_pass) if ok else self.pause(next_pass)
        return ExitCode.OK

    def pause(self, until: float) -> bool:
        self.wakeup.wait(until - time.monotonic())
        return False

    def sleep(self, next_pass: float) -> bool:
        """Until the next pass, or until a time comes due before it: True for the latter."""
        if not self.options.wake:
            return self.pause(next_pass)
        try:
            due = self.next_due(next_pass)
            while not self.stop_requested:
                if self.heard():  # what came in while a statement ran, or since
                    due = self.next_due(next_pass)
                now = time.monotonic()
                if now >= next_pass:
                    return False
                if due is not None and now >= due:
                    return True
                assert self.listening is not None
                ready, _, _ = select.select(
                    [self.wakeup.read_fd, self.listening.fileno()], [], [],
                    min(next_pass, due or next_pass) - now,
                )  # fmt: skip
                if self.wakeup.read_fd in ready:
                    self.wakeup.wait(0)  # only drain it: the handlers recorded the signal
        except psycopg.Error as exc:
            # The pass that follows meets the same outage, and says so; this only stops
            # waking for timers until then.
            log.debug("scanner: not waking for timers: %s", exc)
            if self.listening is not None and self.listening is not self.conn:
                self.listening.close()
            self.conn = self.listening = None
            return self.pause(next_pass)
        return False

    def next_due(self, next_pass: float) -> float | None:
        """Write the next time due before `next_pass` (so that an earlier one set meanwhile
        notifies us); when it is, on the monotonic clock (None: not before the pass)."""
        conn = self.db()
        if self.listening is None or self.listening.closed or self.listening.broken:
            self.listening = conn if self.options.listen_dsn is None else self.listen_session()
            self.listening.execute(LISTEN)
        elif self.options.listen_dsn is None and self.listening is not conn:
            self.listening = conn  # the sweeps' session was opened anew
            self.listening.execute(LISTEN)
        horizon = min(max(next_pass - time.monotonic(), 0.0), HORIZON)
        params = {"horizon": horizon, "since": self.since, "most": WAKE_SETTLE}
        row = conn.execute(QUERIES["wake_timer"], params).fetchone()
        wait = row["wait"] if row is not None else None
        if wait is None or wait >= horizon:
            return None
        return time.monotonic() + max(wait, TIMER_GAP)

    def listen_session(self) -> psycopg.Connection[Any]:
        assert self.options.listen_dsn is not None
        return connect_briefly(
            self.options.listen_dsn, int(self.options.statement_timeout * 1000),
            name="cyclone-scanner-listen", connect_timeout=CONNECT_TIMEOUT,
        )  # fmt: skip

    def heard(self) -> bool:
        """Whether a timer was set earlier than we meant to wake (psycopg keeps what came in
        while a statement ran for the next call; timeout=0 waits for nothing more)."""
        assert self.listening is not None
        return any(True for _ in self.listening.notifies(timeout=0, stop_after=1000))

    def scan_once(self, timely_only: bool = False) -> tuple[dict[str, int], bool]:
        """One pass of every due sweep (only those acting on times, woken for one): rows
        changed by each, and whether the pass finished."""
        counts: dict[str, int] = {}
        now = time.monotonic()
        if self.options.wake:
            try:
                # Woken for a time: a retry's backoff or a token given ahead may be what
                # came due. Either way, the time this pass began (see cyclone_next_due).
                query = QUERIES["wake_ready" if timely_only else "clock_now"]
                self.since = self.db().execute(query).fetchone()["now"]
            except psycopg.OperationalError as exc:
                self.outage.failed(exc)
                self.conn = None
                return counts, False
        for sweep in self.sweeps:
            if self.stop_requested:
                break
            if timely_only and not sweep.sweep.timely:
                continue
            if not sweep.due(now):
                continue
            try:
                counts[sweep.name] = sweep.run(self.db(), pause=self.wakeup.wait)
            except psycopg.OperationalError as exc:
                # The database went away: the next pass reconnects; nothing is half-done,
                # since every batch is one transaction. Logged once per outage, not per pass.
                self.outage.failed(exc)
                self.conn = None
                return counts, False
            except psycopg.Error as exc:
                log.error("%s: %s", sweep.name, exc, extra={"action": "sweep"})
        if counts:
            self.outage.succeeded()
        return counts, True

    def db(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.conn = self.connect()
        return self.conn

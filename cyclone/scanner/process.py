"""The scanner process: run every sweep, pause `scanner.interval`, repeat, until told to stop."""

from __future__ import annotations

import logging
import random
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
from cyclone.engine.sweeps import enabled_sweeps
from cyclone.outage import OutageLog
from cyclone.scanner.base import Sweeper

log = logging.getLogger(__name__)

# Scanners started together (a fleet rebooted at once) spread out over this first pause.
START_STAGGER = 1.0
# Each pause is the interval give or take this share, so scanners on many hosts drift apart.
INTERVAL_JITTER = 0.1


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
            self.options.dsn, int(self.options.statement_timeout * 1000), name="cyclone-scanner",
            connect_timeout=CONNECT_TIMEOUT,
        )  # fmt: skip

    def loop(self) -> int:
        while not self.stop_requested:
            check_parent(self.parent)
            counts, ok = self.scan_once()
            # Every pass is reported, quiet ones too: the supervisor's metrics show the
            # scanner's last pass, and the rows each sweep changed.
            self.channel.send(channel.Scanned(at=time.time(), ok=ok, counts=counts))
            jitter = random.uniform(1 - INTERVAL_JITTER, 1 + INTERVAL_JITTER)
            self.wakeup.wait(self.options.interval * jitter)
        return ExitCode.OK

    def scan_once(self) -> tuple[dict[str, int], bool]:
        """One pass of every due sweep: rows changed by each, and whether the pass finished."""
        counts: dict[str, int] = {}
        now = time.monotonic()
        for sweep in self.sweeps:
            if self.stop_requested:
                break
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

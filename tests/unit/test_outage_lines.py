"""Outage logs (issue 27, item 6): the supervisor's revocation checks, retried every DB_RETRY
seconds while the database is away, log the first failure, then a reminder at most every 30 s,
and one line when it answers; libpq's two-line messages are one line per event."""

from __future__ import annotations

import logging
import time

import psycopg
from fakes import Harness

from cyclone.outage import REMIND_EVERY, one_line
from cyclone.supervisor.arbiter import DB_RETRY
from cyclone.worker import Worker, WorkerOptions

LIBPQ = (
    'connection to server at "127.0.0.1", port 5432 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?"
)


def test_revocation_checks_log_an_outage_once_then_every_30s(h: Harness, caplog) -> None:
    calls = []

    def down(held):
        calls.append(held)
        raise psycopg.OperationalError(LIBPQ)

    h.arbiter.start()
    pid = h.workers()[0]
    h.boot(pid)
    h.lease(pid, kill_after=None)
    h.store.revoked = down
    caplog.set_level(logging.INFO, logger="cyclone.supervisor.arbiter")
    polls = int(REMIND_EVERY * 2 / DB_RETRY) + 1  # a minute past the first failure
    for _ in range(polls):
        h.clock.advance(DB_RETRY)
        h.renewed(7)  # the renewals go on: only the revocation checks fail
        h.arbiter.check_revocations()
    assert len(calls) >= 10
    lines = [r.getMessage() for r in caplog.records if "revoked leases" in r.getMessage()]
    assert len(lines) == 3, lines  # the first, and a reminder at 30 s and at 60 s
    assert all("\n" not in line and "\t" not in line for line in lines)
    assert "Connection refused Is the server running" in lines[0]

    h.store.revoked = lambda held: {}
    h.clock.advance(DB_RETRY)
    h.arbiter.check_revocations()
    assert "checking for revoked leases: database answers again" in caplog.records[-1].getMessage()


def test_one_line_joins_libpqs_lines() -> None:
    assert one_line(psycopg.OperationalError(LIBPQ)).count("\n") == 0
    assert one_line(RuntimeError()) == "RuntimeError"


def test_a_worker_retrying_its_record_warns_once_per_outage(caplog) -> None:
    """The worker retries a failed record every second while its lease holds: one warning
    (then a reminder each 30 s), not one a retry; the line is one line."""
    from types import SimpleNamespace

    from cyclone.workflow import Registry

    options = WorkerOptions(
        number=1, dsn="postgresql:///x", lease_ttl=30.0, heartbeat_interval=5.0,
        poll_interval=1.0, max_steps=0,
    )  # fmt: skip
    worker = Worker(options, Registry(), parent=1)
    now = time.monotonic()
    worker.keeper = SimpleNamespace(renewed_at=lambda lease, at: now)
    lease = SimpleNamespace(step_id=7)
    caplog.set_level(logging.INFO, logger="cyclone.worker.loop")
    for _ in range(5):
        worker.check_trust(lease, now, psycopg.OperationalError(LIBPQ))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"step 7: database unavailable: {one_line(psycopg.OperationalError(LIBPQ))}"]

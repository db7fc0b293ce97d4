"""Database outages: one warning per outage, and workers back as soon as the database is."""

from __future__ import annotations

import logging

import psycopg
from fakes import FakeClock, Harness

from cyclone.child import channel
from cyclone.outage import REMIND_EVERY, OutageLog
from cyclone.supervisor.arbiter import BOOT_BACKOFF_CAP, MAX_BOOT_FAILURES
from cyclone.supervisor.children import ExitStatus, Role

BOOT_ERROR = ExitStatus(code=channel.ExitCode.BOOT_ERROR)
DOWN = psycopg.OperationalError("connection refused")


def scanner(h: Harness) -> int:
    return next(pid for pid, c in h.arbiter.children.items() if c.role is Role.SCANNER)


def scanned(h: Harness, ok: bool, counts: dict[str, int] | None = None) -> None:
    counts = {"deadlines": 0} if counts is None else counts
    h.send(scanner(h), channel.Scanned(at=0.0, ok=ok, counts=counts))


def test_workers_lost_in_an_outage_come_back_when_the_database_answers(h: Harness) -> None:
    workers = h.started()
    scanned(h, ok=False)
    for pid in workers:
        h.exit(pid, BOOT_ERROR)
    assert h.arbiter.boot_failures == 2
    for _ in range(10):  # a long outage: no worker is forked only to fail, none halts us
        h.clock.advance(BOOT_BACKOFF_CAP)
        h.arbiter.tick()
        assert h.arbiter.workers() == [] and not h.arbiter.halted
    scanned(h, ok=True, counts={})  # a pass that touched nothing proves nothing
    h.arbiter.tick()
    assert h.arbiter.workers() == []
    scanned(h, ok=True)
    h.arbiter.tick()  # at once: the backoff (30 s by now) is reset
    (probe,) = h.workers()
    h.arbiter.tick()
    assert h.workers() == [probe]  # one probe at a time, until it boots
    h.boot(probe)
    h.arbiter.tick()
    assert len(h.workers()) == 2 and h.arbiter.boot_failures == 0


def test_presence_tells_the_database_is_back_when_no_scanner_can(h: Harness) -> None:
    workers = h.started()
    h.arbiter.database_failed()  # what a failed presence publish reports
    h.exit(scanner(h), BOOT_ERROR)
    for pid in workers:
        h.exit(pid, BOOT_ERROR)
    h.clock.advance(1.0)
    h.arbiter.tick()
    assert h.arbiter.children == {}
    h.arbiter.database_answered()
    h.arbiter.tick()
    assert len(h.arbiter.children) == 1


def test_a_broken_install_still_halts_when_the_database_is_fine(h: Harness) -> None:
    h.started()
    scanned(h, ok=True)
    for _ in range(3 * MAX_BOOT_FAILURES):
        if h.arbiter.halted:
            break
        h.clock.advance(BOOT_BACKOFF_CAP)
        h.arbiter.tick()
        pending = [pid for pid, c in h.arbiter.children.items() if not c.booted]
        for pid in pending or h.workers()[:1]:
            h.exit(pid, BOOT_ERROR)
    assert h.arbiter.halted


def test_an_outage_is_logged_once_then_every_half_minute_then_its_end(caplog) -> None:
    clock = FakeClock()
    outage = OutageLog(logging.getLogger("test.outage"), "scanner", clock=clock)
    caplog.set_level(logging.INFO, logger="test.outage")
    for _ in range(26):  # what the scanner did in 5 s at interval 200 ms
        outage.failed(DOWN)
        clock.advance(0.2)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert caplog.records[0].getMessage() == "scanner: database unavailable: connection refused"
    clock.advance(REMIND_EVERY)
    outage.failed(DOWN)
    assert "still unavailable after 35s (27 failed attempts)" in caplog.records[-1].getMessage()
    assert outage.succeeded() and not outage.succeeded()
    assert caplog.records[-1].levelname == "INFO"
    assert "answers again after 35.2s (27 failed attempts)" in caplog.records[-1].getMessage()
    outage.failed(DOWN)
    assert caplog.records[-1].getMessage().endswith("database unavailable: connection refused")
    assert len(caplog.records) == 4

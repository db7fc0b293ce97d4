"""A database outage of several seconds: the log says so a few times, not twice a second, and
the workers are back within about a second of the database, whatever backoff they reached."""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proc_helpers import wait_for

from cyclone import embedded
from cyclone.testing import TestEnv

pytestmark = pytest.mark.process

OUTAGE = 5.0  # as long as the one the issue saw


@pytest.fixture
def own_server() -> Iterator[Path]:
    """An embedded PostgreSQL of this test's own, to stop and start."""
    base = Path(tempfile.mkdtemp(prefix="cyc-", dir="/tmp"))
    base.chmod(0o755)
    embedded.ensure_server(base / "pgdata", announce=lambda text: None)
    yield base / "pgdata"
    embedded.stop_server(base / "pgdata", timeout=10)
    shutil.rmtree(base, ignore_errors=True)


def problems(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) ", line)]


def test_an_outage_logs_few_warnings_and_workers_return_once_the_database_does(
    supervisor, own_server
):
    with TestEnv(dsn=embedded.running_dsn(own_server)) as env:
        sup = supervisor(workers=2, dsn=env.dsn)
        before = len(problems(sup.log()))
        embedded.stop_server(own_server)
        time.sleep(OUTAGE)  # the outage itself: nothing to wait for but time
        during = problems(sup.log())[before:]
        embedded.ensure_server(own_server, announce=lambda text: None)
        back_at = time.monotonic()
        wait_for(lambda: len(sup.workers()) == 2, 10, f"two workers again\n{sup.log()}")
        returned = time.monotonic() - back_at
        log = sup.log()
        sup.popen.send_signal(signal.SIGTERM)  # before the schema goes with the TestEnv
        assert sup.popen.wait(10) == 0
        env.conn.close()  # broken by the stop; close() reconnects to drop the schema
    # Before: the scanner alone warned every pass (200 ms here), 25 lines in 5 s.
    # Now: one line each from the scanner, presence and LISTEN (lost, then a failed retry),
    # and three per worker for the connection it lost (more if a probe raced the news).
    assert len(during) <= 14, "\n".join(during)
    assert "halting" not in log
    # Before: the worker backoff had doubled to 8-16 s by the end of the outage.
    assert returned < 4.0, log
    assert "database answers again" in log

"""How long an idle worker sleeps before it looks for work again (cyclone/worker/loop.py)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from cyclone.worker.loop import OWN_FOR, Worker, WorkerOptions
from cyclone.workflow import Registry

POLL = 60.0


def _worker(dispatch: bool) -> Worker:
    options = WorkerOptions(
        number=1, dsn="postgresql:///x", lease_ttl=30.0, heartbeat_interval=5.0,
        poll_interval=POLL, max_steps=0, dispatch=dispatch,
    )  # fmt: skip
    return Worker(options, Registry(), parent=1)


def test_a_worker_leasing_on_its_own_sleeps_only_until_it_may_ask_its_supervisor_again():
    """Told to lease on its own (dispatch failed), an idle worker wakes when it may ask the
    supervisor again, where it waits parked and a step made ready wakes it. Asleep for a whole
    poll interval, it missed every step made ready after the outage until then."""
    worker = _worker(dispatch=True)
    assert worker.idle_wait() == POLL  # parked with the supervisor: the fallback poll
    worker.own_until = time.monotonic() + OWN_FOR
    assert worker.idle_wait() == pytest.approx(OWN_FOR, abs=0.5)
    worker.own_until = time.monotonic() - 1.0  # over: back to the supervisor, no spin
    assert worker.idle_wait() == POLL
    worker.options = replace(worker.options, poll_interval=1.0)
    worker.own_until = time.monotonic() + OWN_FOR
    assert worker.idle_wait() == 1.0  # never longer than the poll interval


def test_a_worker_that_leases_on_its_own_by_config_polls():
    worker = _worker(dispatch=False)
    worker.own_until = time.monotonic() + OWN_FOR
    assert worker.idle_wait() == POLL

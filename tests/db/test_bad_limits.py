"""A negative run deadline, an idempotency key too long to index and a wait timeout no timer
can hold are refused by the client with one clear message, and nothing is written (issue 22,
item 14)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest

import cyclone
from cyclone.clients.calls import MAX_KEY_BYTES
from cyclone.testing import TestEnv

waits = cyclone.Workflow("bad-limits")
waits.wait("w")


def runs(env: TestEnv) -> int:
    return env.conn.execute("SELECT count(*) AS n FROM cyclone_runs").fetchone()["n"]


@pytest.mark.parametrize("deadline", [-1, -0.001, -math.inf, timedelta(seconds=-30)])
def test_a_negative_run_deadline_is_an_error_not_no_deadline(env: TestEnv, deadline: Any):
    env.register(waits)
    with pytest.raises(ValueError, match=r"run_deadline: must not be negative"):
        env.client.submit(waits, {}, run_deadline=deadline)
    with pytest.raises(ValueError, match=r"run_deadline: must not be negative"):
        env.client.submit_many(waits, [{}], run_deadline=deadline)
    assert runs(env) == 0
    # Zero and None still mean none.
    for none in (0, None, timedelta(0)):
        run_id = env.client.submit(waits, {}, run_deadline=none)
        assert env.client.get_run(run_id).deadline_at is None


def test_an_idempotency_key_too_long_to_index_is_refused_before_the_database(env: TestEnv):
    env.register(waits)
    for key in ("k" * (10 * 1024 * 1024), "é" * (MAX_KEY_BYTES // 2 + 1)):
        with pytest.raises(ValueError, match=rf"key: \d+ bytes, over the limit of {MAX_KEY_BYTES}"):
            env.client.submit(waits, {}, key=key)
    assert runs(env) == 0
    first = env.client.submit(waits, {}, key="k" * MAX_KEY_BYTES)  # at the limit: kept
    assert env.client.submit(waits, {}, key="k" * MAX_KEY_BYTES) == first


@pytest.mark.parametrize("timeout", [math.inf, 1e300])
def test_a_wait_timeout_no_timer_can_hold_is_refused(env: TestEnv, timeout: float):
    run_id = env.client.submit(waits, {})
    with pytest.raises(ValueError, match=r"timeout: .* not a usable duration \(None: no limit\)"):
        env.client.wait(run_id, timeout=timeout)

"""The retry rules at a fixed `now`, each pinned so that a one-line change to it fails here:
the backoff's range for every attempt up to its cap (exponent, jitter, cap), what a lease that
expires does on the last attempt and on the others (and not a moment before it expires), and
the lease fence on a failure that comes after its lease was reclaimed."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

import cyclone
from cyclone import engine
from cyclone.engine.steps import BACKOFF_BASE, BACKOFF_CAP
from cyclone.states import ErrorKind, RunState, StepState
from cyclone.testing import TestEnv

# The backoff docs/api.md promises: after attempt n, min(2**(n-1) s, 10 min), less up to half.
BASE, CAP = 1.0, 600.0
# Enough attempts that the last retries are at the cap: 2**(11 - 1) s is over CAP.
ATTEMPTS = 12

stubborn = cyclone.Workflow("retry-rules-stubborn")


@stubborn.task(max_attempts=ATTEMPTS)
def keeps_failing(ctx: cyclone.StepContext) -> None:
    raise RuntimeError("never runs: the test plays the worker")


once = cyclone.Workflow("retry-rules-once")


@once.task(max_attempts=1)
def only_try(ctx: cyclone.StepContext) -> None:
    raise RuntimeError("never runs")


twice = cyclone.Workflow("retry-rules-twice")


@twice.task(max_attempts=2)
def two_tries(ctx: cyclone.StepContext) -> None:
    raise RuntimeError("never runs")


# The three statements that complete a step, each fenced on its own: a task whose run ends
# with it (step_complete_last), one whose next steps depend on it alone (step_complete_chain),
# and any other (step_complete: here, a task a join waits for, besides another).
chained = cyclone.Workflow("retry-rules-chain")
joined = cyclone.Workflow("retry-rules-join")


@chained.task(max_attempts=2)
def head(ctx: cyclone.StepContext) -> int:
    return 1


@chained.task(after=[head])
def tail(ctx: cyclone.StepContext) -> int:
    return 2


@joined.task(max_attempts=2)
def left(ctx: cyclone.StepContext) -> int:
    return 1


@joined.task(max_attempts=2)
def right(ctx: cyclone.StepContext) -> int:
    return 2


@joined.task(after=[left, right])
def both(ctx: cyclone.StepContext) -> int:
    return 3


TTL = 30.0


@pytest.fixture
def env(env: TestEnv) -> TestEnv:
    env.register(stubborn, once, twice, chained, joined)
    return env


def lease_all(env: TestEnv, now: datetime) -> list[engine.Lease]:
    leases = []
    while (lease := engine.lease_step(env.conn, worker="w", lease_ttl=TTL, now=now)) is not None:
        leases.append(lease)
    return leases


def step_row(env: TestEnv, step_id: int) -> dict:
    return env.conn.execute(
        "SELECT state, attempt, error, error_kind, available_at, lease_token, completed_at,"
        "       lease_expires_at FROM cyclone_steps WHERE id = %s",
        [step_id],
    ).fetchone()


def test_the_engine_backs_off_as_documented() -> None:
    assert (BACKOFF_BASE, BACKOFF_CAP) == (BASE, CAP)
    assert BASE * 2 ** (ATTEMPTS - 2) > CAP > BASE * 2 ** (ATTEMPTS - 4)


def test_the_backoff_doubles_per_attempt_with_jitter_up_to_its_cap(env: TestEnv) -> None:
    runs = env.client.submit_many(stubborn, [{}] * 20)
    # random() of this session, seeded: the same draws every run, so the spread checked
    # below is a property of the rule, never of luck.
    env.conn.execute("SELECT setseed(0.25)")
    now = env.now()
    factors: list[float] = []
    for attempt in range(1, ATTEMPTS):
        leases = lease_all(env, now)
        assert len(leases) == len(runs) and {x.attempt for x in leases} == {attempt}
        longest = min(CAP, BASE * 2 ** (attempt - 1))
        for lease in leases:
            assert engine.fail_step(
                env.conn, lease.step_id, lease.token, kind="error", error="boom", now=now
            )
            row = step_row(env, lease.step_id)
            assert row["state"] == StepState.AVAILABLE
            delay = (row["available_at"] - now).total_seconds()
            # Jitter takes up to half of the backoff off, never more, never adds to it.
            assert longest / 2 <= delay <= longest, (attempt, delay)
            factors.append(delay / longest)
        now += timedelta(seconds=CAP + 1)
    # The jitter spreads the retries over the whole half: none of it is left out.
    assert min(factors) < 0.55 and max(factors) > 0.95
    # The last attempt is not retried.
    for lease in lease_all(env, now):
        assert lease.attempt == ATTEMPTS
        engine.fail_step(env.conn, lease.step_id, lease.token, kind="error", error="x", now=now)
        assert step_row(env, lease.step_id)["state"] == StepState.DEAD


def expire(env: TestEnv, lease: engine.Lease) -> datetime:
    """Sweep just after the lease's expiry; returns that moment."""
    expires = step_row(env, lease.step_id)["lease_expires_at"]
    after = expires + timedelta(microseconds=1)
    assert engine.sweep_expired_leases(env.conn, now=after) == 1
    return after


def test_a_lease_is_not_reclaimed_at_the_very_moment_it_expires(env: TestEnv) -> None:
    env.client.submit(twice, {})
    (lease,) = lease_all(env, env.now())
    expires = step_row(env, lease.step_id)["lease_expires_at"]
    assert engine.sweep_expired_leases(env.conn, now=expires) == 0
    assert step_row(env, lease.step_id)["state"] == StepState.RUNNING
    expire(env, lease)
    assert step_row(env, lease.step_id)["state"] == StepState.AVAILABLE


def test_a_lease_that_expires_with_attempts_left_is_retried_at_once(env: TestEnv) -> None:
    run_id = env.client.submit(twice, {})
    (lease,) = lease_all(env, env.now())
    at = expire(env, lease)
    row = step_row(env, lease.step_id)
    assert (row["state"], row["error_kind"], row["available_at"]) == (
        StepState.AVAILABLE, ErrorKind.LEASE_EXPIRED, at,
    )  # fmt: skip
    assert row["lease_token"] is None and row["completed_at"] is None
    assert env.client.get_run(run_id).state == RunState.RUNNING


@pytest.mark.parametrize(("workflow", "attempts"), [(once, 1), (twice, 2)], ids=["1of1", "2of2"])
def test_a_lease_that_expires_on_the_last_attempt_dead_letters_and_fails_the_run(
    env: TestEnv, workflow: cyclone.Workflow, attempts: int
) -> None:
    run_id = env.client.submit(workflow, {})
    now = env.now()
    for _ in range(attempts - 1):
        (lease,) = lease_all(env, now)
        now = expire(env, lease)
    (lease,) = lease_all(env, now)
    at = expire(env, lease)
    row = step_row(env, lease.step_id)
    assert (row["state"], row["error_kind"], row["completed_at"]) == (
        StepState.DEAD, ErrorKind.LEASE_EXPIRED, at,
    )  # fmt: skip
    assert row["error"] == f"lease expired on attempt {lease.attempt} (held by w)"
    st = env.client.get_run(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.LEASE_EXPIRED)
    assert lease_all(env, at + timedelta(hours=1)) == []


def test_a_late_failure_after_a_reclaim_changes_nothing(env: TestEnv) -> None:
    env.client.submit(twice, {})
    (old,) = lease_all(env, env.now())
    at = expire(env, old)
    (new,) = lease_all(env, at)  # the retry, on another worker
    before = step_row(env, new.step_id)
    attempts = env.client.attempts(new.step_id)
    # The first holder wakes up and reports its failure under the lease it lost.
    assert not engine.fail_step(
        env.conn, old.step_id, old.token, kind="error", error="late", retry=False, now=at
    )
    assert step_row(env, new.step_id) == before
    assert env.client.attempts(new.step_id) == attempts


def test_a_late_failure_of_a_dead_letter_leaves_it_and_its_run_alone(env: TestEnv) -> None:
    run_id = env.client.submit(once, {})
    (old,) = lease_all(env, env.now())
    at = expire(env, old)
    before, run_before = step_row(env, old.step_id), env.client.get_run(run_id)
    assert not engine.fail_step(
        env.conn, old.step_id, old.token, kind="error", error="late", now=at
    )
    assert step_row(env, old.step_id) == before
    assert env.client.get_run(run_id) == run_before


def test_a_late_failure_of_a_step_waiting_to_be_retried_leaves_its_gate(env: TestEnv) -> None:
    env.client.submit(twice, {})
    (old,) = lease_all(env, env.now())
    at = expire(env, old)
    before = step_row(env, old.step_id)
    assert not engine.fail_step(
        env.conn, old.step_id, old.token, kind="error", error="late", now=at
    )
    assert step_row(env, old.step_id) == before


@pytest.mark.parametrize("workflow", [twice, chained, joined], ids=["last", "chain", "join"])
def test_a_late_completion_after_a_reclaim_changes_nothing(
    env: TestEnv, workflow: cyclone.Workflow
) -> None:
    run_id = env.client.submit(workflow, {})
    old = lease_all(env, env.now())[0]
    expires = step_row(env, old.step_id)["lease_expires_at"]
    at = expires + timedelta(microseconds=1)
    engine.sweep_expired_leases(env.conn, now=at)
    new = next(x for x in lease_all(env, at) if x.step_id == old.step_id)
    steps = env.conn.execute("SELECT * FROM cyclone_steps ORDER BY id").fetchall()
    assert not engine.complete_step(env.conn, old, "late", now=at)
    assert env.conn.execute("SELECT * FROM cyclone_steps ORDER BY id").fetchall() == steps
    assert env.client.get_run(run_id).state == RunState.RUNNING
    assert engine.complete_step(env.conn, new, "on time", now=at)  # its holder's, once

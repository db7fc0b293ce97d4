"""ctx.transaction(): a handler's writes commit with its step's completion, under its lease, once.

The in-process harness runs steps as a worker does (a second session for the handler's
transaction); the stale holder below is driven by hand, lease by lease, on the test's clock.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

import cyclone
from cyclone import engine, runner
from cyclone.context import Effects, StepContext
from cyclone.errors import CycloneError, LeaseLost
from cyclone.states import RunState, StepState
from cyclone.testing import TestEnv

paid = cyclone.Workflow("fenced-pay")
FAIL_AFTER_BLOCK: set[int] = set()


@paid.task(max_attempts=3)
def charge(ctx: StepContext) -> dict[str, int]:
    with ctx.transaction() as conn:
        conn.execute(
            "INSERT INTO payments (run_id, attempt) VALUES (%s, %s)", (ctx.run_id, ctx.attempt)
        )
    if ctx.attempt in FAIL_AFTER_BLOCK:
        raise RuntimeError("failed after writing")
    return {"attempt": ctx.attempt}


@paid.task(after=[charge])
def receipt(ctx: StepContext) -> int:
    return ctx.results["charge"]["attempt"]


two_blocks = cyclone.Workflow("fenced-two-blocks")


@two_blocks.task(max_attempts=1)
def partial(ctx: StepContext) -> str:
    with ctx.transaction() as conn:
        conn.execute("INSERT INTO payments (run_id, attempt) VALUES (%s, 1)", (ctx.run_id,))
    with pytest.raises(ZeroDivisionError), ctx.transaction() as conn:
        conn.execute("INSERT INTO payments (run_id, attempt) VALUES (%s, 2)", (ctx.run_id,))
        _ = 1 / 0
    return "kept the first block"


asynchronous = cyclone.Workflow("fenced-async")


@asynchronous.task(max_attempts=1)
async def charge_async(ctx: StepContext) -> str:
    async with ctx.transaction() as conn:
        conn.execute("INSERT INTO payments (run_id, attempt) VALUES (%s, %s)", (ctx.run_id, 1))
    return "ok"


@pytest.fixture
def pay_env(env: TestEnv) -> TestEnv:
    env.conn.execute("CREATE TABLE payments (run_id uuid, attempt int)")
    env.register(paid, two_blocks, asynchronous)
    FAIL_AFTER_BLOCK.clear()
    return env


def payments(env: TestEnv, run_id: str) -> list[int]:
    rows = env.conn.execute(
        "SELECT attempt FROM payments WHERE run_id = %s ORDER BY attempt", (run_id,)
    ).fetchall()
    return [r["attempt"] for r in rows]


def test_the_effects_commit_with_the_completion(pay_env: TestEnv) -> None:
    run_id = pay_env.client.submit(paid, {})
    assert pay_env.run_until_complete(run_id).state == RunState.COMPLETED
    assert payments(pay_env, run_id) == [1]


def test_a_handler_that_fails_after_its_block_commits_nothing_and_its_retry_commits_once(
    pay_env: TestEnv,
) -> None:
    FAIL_AFTER_BLOCK.add(1)
    run_id = pay_env.client.submit(paid, {})
    assert pay_env.run_until_complete(run_id).state == RunState.COMPLETED
    assert payments(pay_env, run_id) == [2]
    assert pay_env.client.get_run(run_id).output == {"receipt": 2}


def test_a_block_left_by_an_exception_undoes_its_own_writes_only(pay_env: TestEnv) -> None:
    run_id = pay_env.client.submit(two_blocks, {})
    assert pay_env.run_until_complete(run_id).state == RunState.COMPLETED
    assert payments(pay_env, run_id) == [1]


def test_an_async_handler_uses_async_with(pay_env: TestEnv) -> None:
    run_id = pay_env.client.submit(asynchronous, {})
    assert pay_env.run_until_complete(run_id).state == RunState.COMPLETED
    assert payments(pay_env, run_id) == [1]


def _lease(env: TestEnv, ttl: float = 5.0) -> Any:
    lease = engine.lease_step(env.conn, worker="w", lease_ttl=ttl, now=env.now())
    assert lease is not None
    return lease


def _effects_session(env: TestEnv) -> psycopg.Connection[Any]:
    conn = psycopg.connect(env.dsn, row_factory=psycopg.rows.dict_row)
    conn.autocommit = False
    return conn


def test_a_holder_whose_lease_was_reclaimed_cannot_commit_its_effects(pay_env: TestEnv) -> None:
    """A whole host frozen past its lease: the step is reclaimed and completed by another
    worker while the frozen one sits between its block and its commit. When it wakes, its
    completion, and with it its effects, match no lease."""
    run_id = pay_env.client.submit(paid, {})
    stale = _lease(pay_env)
    session = _effects_session(pay_env)
    try:
        effects = Effects(lambda: session, stale.step_id, stale.token)
        outcome = runner.execute(pay_env.conn, pay_env.registry, stale, effects=effects)
        assert outcome.ok and effects.pending
        # Frozen: the lease lapses, the scanner reclaims it, attempt 2 runs and completes.
        pay_env.advance_time(timedelta(seconds=6))
        assert pay_env.scan() >= 1
        assert pay_env.run_one()
        assert payments(pay_env, run_id) == [2]
        # Wakes up and records: nothing of it commits.
        assert runner.record_effects(effects, stale, outcome, now=pay_env.now()) is False
        assert not effects.pending
    finally:
        session.close()
    assert payments(pay_env, run_id) == [2]
    charge_step = min(pay_env.client.steps(run_id), key=lambda s: s.id)
    assert (charge_step.state, charge_step.attempt) == (StepState.COMPLETED, 2)


def test_a_holder_whose_lease_is_gone_fails_as_its_block_begins(pay_env: TestEnv) -> None:
    pay_env.client.submit(paid, {})
    stale = _lease(pay_env)
    pay_env.advance_time(timedelta(seconds=6))
    pay_env.scan()
    session = _effects_session(pay_env)
    try:
        ctx = runner.make_context(
            pay_env.conn, stale, effects=Effects(lambda: session, stale.step_id, stale.token)
        )
        with pytest.raises(LeaseLost), ctx.transaction():
            pytest.fail("the block ran without a lease")
        assert session.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        session.close()


def test_a_session_lost_before_the_commit_commits_nothing_and_the_retry_commits_once(
    pay_env: TestEnv,
) -> None:
    """PostgreSQL restarted (or the session was ended) between the block and the commit."""
    run_id = pay_env.client.submit(paid, {})
    lease = _lease(pay_env)
    session = _effects_session(pay_env)
    try:
        effects = Effects(lambda: session, lease.step_id, lease.token)
        outcome = runner.execute(pay_env.conn, pay_env.registry, lease, effects=effects)
        pid = session.info.backend_pid
        pay_env.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            runner.record_effects(effects, lease, outcome, now=pay_env.now())
    finally:
        session.close()
    # What the worker does then: record a failure, fenced (it would change nothing had the
    # completion gone through), and the retry writes the effects once.
    assert engine.fail_step(pay_env.conn, lease.step_id, lease.token, kind="error", error="x")
    assert payments(pay_env, run_id) == []
    assert pay_env.run_until_complete(run_id).state == RunState.COMPLETED
    assert payments(pay_env, run_id) == [2]


def test_outside_a_running_step_there_is_no_transaction() -> None:
    ctx = StepContext(run_id="r", step_id=1, workflow="w", node="n", attempt=1, input=None)
    with pytest.raises(CycloneError, match="only available while a step runs"), ctx.transaction():
        pass

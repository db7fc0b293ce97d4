"""The revocation check tells a lease revoked from one its holder ended by recording the step."""

from __future__ import annotations

from datetime import timedelta

import cyclone
from cyclone import engine
from cyclone.testing import TestEnv

wf = cyclone.Workflow("wf-revocations")


@wf.task(max_attempts=2, timeout=timedelta(minutes=5))
def one(ctx: cyclone.StepContext) -> int:
    return 1


def leased(env: TestEnv, **submit: object) -> tuple[str, engine.Lease]:
    env.register(wf)
    run_id = env.client.submit(wf, {}, **submit)
    lease = engine.lease_step(env.conn, worker="w", now=env.now(), lease_ttl=30)
    assert lease is not None and lease.run_id == run_id
    return run_id, lease


def reason(env: TestEnv, lease: engine.Lease) -> str | None:
    return engine.revoked_leases(env.conn, {lease.step_id: lease.token}).get(lease.step_id, "held")


def test_a_held_lease_is_not_reported(env: TestEnv) -> None:
    _, lease = leased(env)
    assert reason(env, lease) == "held"


def test_a_step_its_holder_completed_or_failed_is_finished_not_revoked(env: TestEnv) -> None:
    _, lease = leased(env)
    assert engine.complete_step(env.conn, lease, 1, now=env.now())
    assert reason(env, lease) == engine.FINISHED
    _, lease = leased(env)
    assert engine.fail_step(env.conn, lease.step_id, lease.token, kind="error", error="boom")
    assert reason(env, lease) == engine.FINISHED  # to be retried: the holder's own doing


def test_cancel_deadline_and_reclaim_are_revocations_with_their_reason(env: TestEnv) -> None:
    run_id, lease = leased(env)
    assert engine.cancel_run(env.conn, run_id, now=env.now())
    assert reason(env, lease) == "cancelled"
    _, lease = leased(env, run_deadline=timedelta(seconds=10))
    env.advance_time(timedelta(seconds=11))
    env.scan()
    assert reason(env, lease) == "deadline"
    _, lease = leased(env)
    env.advance_time(timedelta(seconds=31))
    env.scan()
    assert reason(env, lease) == "lease_expired"


def test_a_step_that_is_gone_is_revoked_with_no_reason(env: TestEnv) -> None:
    assert engine.revoked_leases(env.conn, {10**12: "00000000-0000-0000-0000-000000000000"}) == {
        10**12: None
    }

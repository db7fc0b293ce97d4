"""A lease that lapsed because the database itself was down spends no attempt (issue 22,
item 9): the server's start time tells that case apart from a lost host."""

from __future__ import annotations

from datetime import timedelta

import cyclone
from cyclone import engine
from cyclone.engine.sweeps import SWEEPS
from cyclone.scanner.process import ScannerOptions, make_sweeps
from cyclone.states import StepState
from cyclone.testing import TestEnv

once = cyclone.Workflow("wf-outage-once")


@once.task(max_attempts=1, timeout=timedelta(minutes=5))
def only(ctx: cyclone.StepContext) -> int:
    return 1


def lapsing_at(env: TestEnv, expiry) -> engine.Lease:
    """A lease of the one-attempt task, as if its last renewal left it to lapse at `expiry`."""
    env.register(once)
    env.client.submit(once, {})
    lease = engine.lease_step(env.conn, worker="host:1", now=env.now(), lease_ttl=5.0)
    assert lease is not None
    env.conn.execute(
        "UPDATE cyclone_steps SET lease_expires_at = %s WHERE id = %s", (expiry, lease.step_id)
    )
    return lease


def server_start(env: TestEnv):
    return env.conn.execute("SELECT pg_postmaster_start_time() AS t").fetchone()["t"]


def test_a_lease_that_lapsed_while_the_server_was_down_goes_back_with_its_attempt(env: TestEnv):
    # Renewed last before the server (re)started: no holder could renew it meanwhile.
    lease = lapsing_at(env, server_start(env) - timedelta(seconds=5))
    now = max(env.now(), server_start(env) + timedelta(seconds=1))
    assert engine.sweep_expired_leases(env.conn, now=now, outage_grace=30.0) == 1
    (step,) = env.client.steps(lease.run_id)
    assert (step.state, step.attempt) == (StepState.AVAILABLE, 0)  # its only attempt, unspent
    assert "while the database restarted: attempt not spent" in step.error
    history = env.conn.execute(
        "SELECT attempt, error_kind FROM cyclone_step_attempts WHERE step_id = %s", (step.id,)
    ).fetchall()
    assert history == [{"attempt": 1, "error_kind": "lease_expired"}]
    again = engine.lease_step(env.conn, worker="host:2", now=now, lease_ttl=5.0)
    assert again is not None and again.attempt == 1


def test_a_lease_that_lapsed_long_after_the_start_spends_its_attempt(env: TestEnv) -> None:
    lease = lapsing_at(env, server_start(env) + timedelta(seconds=60))
    now = max(env.now(), server_start(env) + timedelta(seconds=70))
    assert engine.sweep_expired_leases(env.conn, now=now, outage_grace=30.0) == 1
    (step,) = env.client.steps(lease.run_id)
    assert (step.state, step.attempt) == (StepState.DEAD, 1)


def test_without_a_grace_every_lapsed_lease_spends_its_attempt(env: TestEnv) -> None:
    lease = lapsing_at(env, server_start(env) - timedelta(seconds=5))
    now = max(env.now(), server_start(env) + timedelta(seconds=1))
    assert engine.sweep_expired_leases(env.conn, now=now) == 1
    (step,) = env.client.steps(lease.run_id)
    assert step.state == StepState.DEAD


def test_the_scanner_passes_its_workers_lease_ttl_as_the_grace(env: TestEnv) -> None:
    options = ScannerOptions(dsn=env.dsn, interval=1, batch_size=10, retention=0, lease_ttl=30)
    (sweeper,) = [s for s in make_sweeps(options) if s.sweep.name == "expired_leases"]
    assert sweeper.settings["outage_grace"] == 30
    assert next(s for s in SWEEPS if s.name == "expired_leases").takes == ("outage_grace",)


limited = cyclone.Workflow("wf-outage-limited")


@limited.task(rate_limit="outage-api", max_attempts=1, timeout=timedelta(minutes=5))
def call(ctx: cyclone.StepContext) -> int:
    return 1


def test_a_rate_limited_lease_that_lapsed_while_the_server_was_down_takes_a_new_token(
    env: TestEnv,
) -> None:
    """Its handler ran before the restart and spent its token: the attempt comes back, the
    token does not (migration 31; kept, it would start again uncounted by its bucket)."""
    env.register(limited)
    env.client.set_rate_limit("outage-api", rate=1, per=timedelta(hours=1), burst=1)
    env.client.submit(limited, {})
    env.scan()  # admits it on the bucket's one token
    lease = engine.lease_step(env.conn, worker="host:1", now=env.now(), lease_ttl=5.0)
    assert lease is not None
    env.conn.execute(
        "UPDATE cyclone_steps SET lease_expires_at = %s WHERE id = %s",
        (server_start(env) - timedelta(seconds=5), lease.step_id),
    )
    now = max(env.now(), server_start(env) + timedelta(seconds=1))
    assert engine.sweep_expired_leases(env.conn, now=now, outage_grace=30.0) == 1
    step = env.conn.execute(
        "SELECT state, held, attempt FROM cyclone_steps WHERE id = %s", (lease.step_id,)
    ).fetchone()
    assert step == {"state": "waiting", "held": True, "attempt": 0}
    assert engine.lease_step(env.conn, worker="host:2", now=now, lease_ttl=5.0) is None

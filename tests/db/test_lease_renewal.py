"""The supervisor renews its workers' leases in one statement, fenced by each lease's token."""

from __future__ import annotations

import select
import time
from datetime import timedelta

import psycopg
import pytest

import cyclone
from cyclone import engine
from cyclone.engine.renewal import renew_leases
from cyclone.supervisor.renewal import Renewer
from cyclone.testing import TestEnv

wf = cyclone.Workflow("wf-renewal")


@wf.task(max_attempts=2, timeout=timedelta(minutes=5))
def one(ctx: cyclone.StepContext) -> int:
    return 1


def leases(env: TestEnv, n: int) -> list[engine.Lease]:
    env.register(wf)
    env.client.submit_many(wf, [{}] * n)
    found = [engine.lease_step(env.conn, worker="w", now=env.now(), lease_ttl=5) for _ in range(n)]
    assert all(found)
    return found  # type: ignore[return-value]


def expiry(env: TestEnv, step_id: int):
    row = env.conn.execute(
        "SELECT lease_expires_at FROM cyclone_steps WHERE id = %s", (step_id,)
    ).fetchone()
    return row["lease_expires_at"]


def test_one_statement_renews_every_lease_named_with_its_token(env: TestEnv) -> None:
    held = leases(env, 3)
    later = env.now() + timedelta(seconds=4)
    renewed = renew_leases(
        env.conn, [(lease.step_id, lease.token) for lease in held], lease_ttl=30, now=later
    )
    assert renewed == {lease.step_id for lease in held}
    for lease in held:
        assert expiry(env, lease.step_id) == later + timedelta(seconds=30)


def test_a_lease_revoked_or_reclaimed_is_not_renewed_and_the_others_are(env: TestEnv) -> None:
    kept, reclaimed, wrong = leases(env, 3)
    env.advance_time(timedelta(seconds=10))  # every lease lapsed...
    renew_leases(env.conn, [(kept.step_id, kept.token)], lease_ttl=30, now=env.now())
    assert engine.sweep_expired_leases(env.conn, now=env.now()) == 2  # ...and two reclaimed
    before = expiry(env, reclaimed.step_id)
    asked = [(kept.step_id, kept.token), (reclaimed.step_id, reclaimed.token),
             (wrong.step_id, kept.token)]  # fmt: skip
    assert renew_leases(env.conn, asked, lease_ttl=30, now=env.now()) == {kept.step_id}
    assert expiry(env, reclaimed.step_id) == before


def test_the_supervisors_session_sends_the_renewal_without_waiting_for_its_answer(
    env: TestEnv,
) -> None:
    held = leases(env, 2)
    watched: list[int] = []
    renewer = Renewer(env.dsn, lease_ttl=30, watch=lambda fd: watched.append(fd) or fd)
    try:
        renewer.send([(lease.step_id, lease.token) for lease in held])
        assert renewer.in_flight and watched == [renewer.fd]
        deadline = time.monotonic() + 10
        while (renewed := renewer.result()) is None:
            assert time.monotonic() < deadline
            select.select([renewer.fd], [], [], 1.0)
        assert renewed == {lease.step_id for lease in held} and not renewer.in_flight
        # The session ended under it (a restart, say): the answer is an error, the session goes.
        pid = renewer.conn.info.backend_pid
        env.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.Error):
            renewer.send([(held[0].step_id, held[0].token)])
            deadline = time.monotonic() + 10
            while renewer.result() is None:
                assert time.monotonic() < deadline
                select.select([renewer.fd], [], [], 1.0)
        assert renewer.conn is None and not renewer.in_flight
    finally:
        renewer.close()

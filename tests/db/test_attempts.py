"""Every failed attempt's error is kept: the step row holds only the latest (issue 11, item 19)."""

from __future__ import annotations

from datetime import timedelta

import pytest

import cyclone
from cyclone import engine
from cyclone.cli import main
from cyclone.engine.dlq import retry_dead_step
from cyclone.states import ErrorKind, RunState, StepState
from cyclone.testing import TestEnv

flaky = cyclone.Workflow("attempts-flaky")


@flaky.task(max_attempts=3)
def wobble(ctx: cyclone.StepContext) -> int:
    if ctx.attempt < 3:
        raise RuntimeError(f"boom on attempt {ctx.attempt}\nsecond line of the error")
    return ctx.attempt


slow = cyclone.Workflow("attempts-slow")


@slow.task(max_attempts=2)
def crawl(ctx: cyclone.StepContext) -> str:
    return "done"


def history(env: TestEnv, step_id: int) -> list[tuple[int, ErrorKind]]:
    return [(a.attempt, a.error_kind) for a in env.client.attempts(step_id)]


def test_errors_of_attempts_that_failed_before_one_completed_are_kept(env: TestEnv) -> None:
    env.register(flaky)
    run_id = env.client.submit(flaky, {})
    assert env.run_until_complete(run_id).state == RunState.COMPLETED
    (step,) = env.client.steps(run_id)
    assert step.error is None  # the completion cleared the row's own error
    kept = env.client.attempts(step.id)
    assert [(a.attempt, a.error_kind) for a in kept] == [(1, "error"), (2, "error")]
    assert "boom on attempt 1" in (kept[0].error or "") and kept[0].worker
    row = env.conn.execute(
        "SELECT attempts FROM cyclone_v_steps WHERE id = %s", [step.id]
    ).fetchone()
    assert [a["attempt"] for a in row["attempts"]] == [1, 2]
    assert "boom on attempt 2" in row["attempts"][1]["error"]


def test_a_dlq_retry_keeps_the_deadline_error_it_clears(env: TestEnv) -> None:
    env.register(slow)
    run_id = env.client.submit(slow, {}, run_deadline=timedelta(seconds=10))
    lease = engine.lease_step(env.conn, worker="w1", now=env.now(), lease_ttl=60)
    assert lease is not None
    env.advance_time(timedelta(seconds=11))
    env.scan()
    (step,) = env.client.steps(run_id)
    assert (step.state, step.error_kind) == (StepState.DEAD, ErrorKind.DEADLINE)
    retry_dead_step(env.conn, step.id, deadline=60, now=env.now())
    (step,) = env.client.steps(run_id)
    assert (step.state, step.error) == (StepState.AVAILABLE, None)
    assert history(env, step.id) == [(1, ErrorKind.DEADLINE)]
    assert env.client.attempts(step.id)[0].error == "run deadline exceeded"
    assert env.run_until_complete(run_id).state == RunState.COMPLETED
    assert history(env, step.id) == [(1, ErrorKind.DEADLINE)]


def test_a_reclaimed_lease_and_a_child_failure_are_kept_too(env: TestEnv) -> None:
    env.register(slow)
    run_id = env.client.submit(slow, {})
    lease = engine.lease_step(env.conn, worker="lost-host:1", now=env.now(), lease_ttl=5)
    assert lease is not None
    env.advance_time(timedelta(seconds=6))
    env.scan()
    (step,) = env.client.steps(run_id)
    (kept,) = env.client.attempts(step.id)
    assert (kept.attempt, kept.error_kind, kept.worker) == (1, "lease_expired", "lost-host:1")
    assert env.run_until_complete(run_id).state == RunState.COMPLETED
    # Retention deletes the history with its steps.
    engine.sweep_retention(env.conn, retention=0, now=env.now() + timedelta(seconds=1))
    left = env.conn.execute("SELECT count(*) AS n FROM cyclone_step_attempts").fetchone()
    assert left["n"] == 0


def test_cli_dlq_attempts_prints_every_error_whole(env: TestEnv, capsys) -> None:
    env.register(flaky)
    run_id = env.client.submit(flaky, {})
    env.run_until_complete(run_id)
    (step,) = env.client.steps(run_id)
    assert main(["--dsn", env.dsn, "dlq", "attempts", str(step.id)]) == 0
    out = capsys.readouterr().out
    assert "attempt 1  error" in out and "attempt 2  error" in out
    # The whole error (a traceback here), on lines of its own.
    assert "    RuntimeError: boom on attempt 1\n    second line of the error\n" in out
    assert "    RuntimeError: boom on attempt 2\n    second line of the error\n" in out
    assert main(["--dsn", env.dsn, "dlq", "attempts", str(step.id), "--json"]) == 0
    assert '"error_kind": "error"' in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["0", "x", "99999999"])
def test_cli_dlq_attempts_of_no_step_is_not_found(env: TestEnv, bad: str, capsys) -> None:
    assert main(["--dsn", env.dsn, "dlq", "attempts", bad]) in (1, 2)

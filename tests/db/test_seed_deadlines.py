"""Every engine sentence of docs/run-deadlines.md, against a real PostgreSQL."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

import cyclone
from cyclone import engine, runner
from cyclone.states import DEADLINE_ERROR, ErrorKind, RunState, StepState
from cyclone.testing import TestEnv

DEADLINE_STEPS_SQL = """
SELECT run_id, node, kind, error, completed_at
  FROM cyclone_v_steps
 WHERE error_kind = 'deadline'
 ORDER BY completed_at DESC;
"""

DEADLINE_RUNS_SQL = """
SELECT DISTINCT r.id, r.workflow, r.finished_at
  FROM cyclone_runs r
  JOIN cyclone_steps s ON s.run_id = r.id
 WHERE s.error_kind = 'deadline'
 ORDER BY r.finished_at DESC;
"""

parks = cyclone.Workflow("seed-parks")


@parks.task()
def prepare(ctx):
    return {"ok": True}


parks.wait("approval", signal="approved", after=[prepare])


@parks.task(after=["approval"])
def ship(ctx):
    return "shipped"


fanout = cyclone.Workflow("seed-fanout")


@fanout.map(items=lambda ctx: list(range(3)))
def each(ctx):
    return ctx.item


shipping = cyclone.Workflow("seed-shipping")
shipping.wait("carrier", signal="picked-up")

parent = cyclone.Workflow("seed-parent")


@parent.task()
def order(ctx):
    return {"id": 7}


parent.child("ship", shipping, after=[order], input=lambda ctx: ctx.results["order"])


def test_testing_without_waiting_example_fails_the_parked_run_with_deadline(env: TestEnv):
    run_id = cyclone.submit(env.client, parks, {"n": 1}, run_deadline=timedelta(hours=1))
    env.run_until_idle()  # run parks, still running
    assert env.client.get_run(run_id).state == RunState.RUNNING
    env.advance_time(timedelta(hours=2))  # jump past the deadline
    st = env.run_until_complete(run_id)  # scanner fails it
    assert st.state == RunState.FAILED
    assert st.error_kind == "deadline"
    assert st.error == DEADLINE_ERROR


def test_deadline_dead_letters_available_running_and_waiting_steps(env: TestEnv):
    env.register(parks, fanout)
    waiting = env.client.submit(parks, {}, run_deadline=timedelta(minutes=30))
    env.run_until_idle()
    available = env.client.submit(fanout, {}, run_deadline=timedelta(minutes=30))
    running = env.client.submit(parks, {}, run_deadline=timedelta(minutes=30))
    lease = engine.lease_step(env.conn, worker="t", workflows=["seed-parks"], now=env.now())
    assert lease is not None and lease.run_id == running
    env.advance_time(timedelta(minutes=31))
    assert engine.sweep_deadlines(env.conn, now=env.now()) == 3
    for run_id in (waiting, available, running):
        st = env.client.get_run(run_id)
        assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.DEADLINE)
        live = [s for s in env.client.steps(run_id) if s.state != StepState.COMPLETED]
        assert live and all(s.state == StepState.DEAD for s in live)
        assert all((s.error_kind, s.error) == ("deadline", DEADLINE_ERROR) for s in live)


def test_late_result_of_a_killed_handler_is_discarded(env: TestEnv):
    env.register(parks)
    run_id = env.client.submit(parks, {}, run_deadline=timedelta(minutes=1))
    lease = engine.lease_step(env.conn, worker="t", now=env.now())
    done = threading.Event()
    env.advance_time(timedelta(minutes=2))
    env.scan()
    # The handler ignored ctx.done and returns anyway: its result changes nothing.
    outcome = runner.execute(env.conn, env.registry, lease, done=done)
    assert outcome.ok
    assert runner.record(env.conn, lease, outcome, now=env.now()) is False
    step = env.client.steps(run_id)[0]
    assert (step.state, step.error_kind) == (StepState.DEAD, ErrorKind.DEADLINE)
    assert env.conn.execute("SELECT output FROM cyclone_steps").fetchone()["output"] is None
    assert engine.heartbeat(env.conn, lease.step_id, lease.token, now=env.now()) is False


def test_deadline_failure_is_distinct_from_an_ordinary_step_failure(env: TestEnv):
    flaky = cyclone.Workflow("seed-flaky")

    @flaky.task(max_attempts=1)
    def boom(ctx):
        raise RuntimeError("ordinary failure")

    env.register(parks)
    ordinary = env.client.submit(flaky, {})
    st = env.run_until_complete(ordinary)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.ERROR)
    assert "ordinary failure" in st.error
    late = env.client.submit(parks, {}, run_deadline=timedelta(minutes=5))
    env.run_until_idle()
    env.advance_time(timedelta(minutes=6))
    st = env.run_until_complete(late)
    assert (st.state, st.error_kind, st.error) == (
        RunState.FAILED, ErrorKind.DEADLINE, DEADLINE_ERROR,
    )  # fmt: skip
    # Told apart wherever a failure is read: the run, its dead step, the DLQ by reason, and
    # the seed page's queries (which select by kind).
    [boom_step] = env.client.steps(ordinary)
    [approval] = [x for x in env.client.steps(late) if x.state == StepState.DEAD]
    assert (boom_step.error_kind, approval.error_kind) == (ErrorKind.ERROR, ErrorKind.DEADLINE)
    by_reason = {
        kind: [x.id for x in env.client.exhausted(cyclone.ExhaustedQuery(reason=kind))]
        for kind in (ErrorKind.ERROR, ErrorKind.DEADLINE)
    }
    assert by_reason == {ErrorKind.ERROR: [boom_step.id], ErrorKind.DEADLINE: [approval.id]}
    assert {str(r["run_id"]) for r in env.conn.execute(DEADLINE_STEPS_SQL).fetchall()} == {late}
    assert [str(r["id"]) for r in env.conn.execute(DEADLINE_RUNS_SQL).fetchall()] == [late]


def test_dlq_and_both_sql_queries_select_the_deadline_steps_as_written(env: TestEnv):
    env.register(parks)
    killed = env.client.submit(parks, {}, run_deadline=timedelta(minutes=5))
    survivor = env.client.submit(parks, {})
    env.run_until_idle()
    env.advance_time(timedelta(minutes=10))
    env.run_until_idle()
    dlq = env.client.exhausted(cyclone.ExhaustedQuery(reason=ErrorKind.DEADLINE))
    assert [(s.run_id, s.node) for s in dlq] == [(killed, "approval")]
    assert dlq[0].error == DEADLINE_ERROR
    rows = env.conn.execute(DEADLINE_STEPS_SQL).fetchall()
    assert [(str(r["run_id"]), r["node"], r["kind"], r["error"]) for r in rows] == [
        (killed, "approval", "wait", DEADLINE_ERROR)
    ]
    assert rows[0]["completed_at"] is not None
    runs = env.conn.execute(DEADLINE_RUNS_SQL).fetchall()
    assert [(str(r["id"]), r["workflow"]) for r in runs] == [(killed, "seed-parks")]
    assert env.client.get_run(survivor).state == RunState.RUNNING


def test_v_runs_has_no_error_kind_and_v_steps_has_completed_at_for_discarded(env: TestEnv):
    cols = {
        r["column_name"]
        for r in env.conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = 'cyclone_v_runs'"
        )
    }
    assert "error_kind" not in cols
    run_id = env.client.submit(parks, {})
    env.client.cancel(run_id)
    row = env.conn.execute("SELECT state, completed_at FROM cyclone_v_steps").fetchone()
    assert row["state"] == "discarded" and row["completed_at"] is not None
    steps_cols = {
        r["column_name"]
        for r in env.conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = 'cyclone_v_steps'"
        )
    }
    assert "discarded_at" not in steps_cols


@pytest.mark.parametrize("deadline", [-5, timedelta(minutes=-1), -0.001])
def test_a_negative_deadline_is_refused_and_writes_nothing(env: TestEnv, deadline):
    # Every run is bounded: a deadline that could be read as "none" must not fail open.
    with pytest.raises(ValueError, match="run_deadline: must not be negative"):
        env.client.submit(parks, {}, run_deadline=deadline)
    assert env.conn.execute("SELECT count(*) AS n FROM cyclone_runs").fetchone()["n"] == 0


@pytest.mark.parametrize("deadline", [None, 0, timedelta(0)])
def test_no_deadline_or_a_zero_one_means_no_deadline(env: TestEnv, deadline):
    run_id = env.client.submit(parks, {}, run_deadline=deadline)
    assert env.client.get_run(run_id).deadline_at is None
    env.run_until_idle()
    env.advance_time(timedelta(days=365))
    assert env.scan() == 0
    assert env.client.get_run(run_id).state == RunState.RUNNING


def test_deadline_is_wall_clock_from_submit(env: TestEnv):
    run_id = env.client.submit(parks, {}, run_deadline=timedelta(minutes=30))
    st = env.client.get_run(run_id)
    assert st.deadline_at - st.created_at == timedelta(minutes=30)


def test_scanner_does_not_touch_a_run_that_finished_before_its_deadline(env: TestEnv):
    run_id = env.client.submit(fanout, {}, run_deadline=timedelta(minutes=5))
    finished = env.run_until_complete(run_id)
    assert finished.state == RunState.COMPLETED
    env.advance_time(timedelta(hours=1))
    assert engine.sweep_deadlines(env.conn, now=env.now()) == 0
    assert env.client.get_run(run_id) == finished
    assert all(s.error_kind is None for s in env.client.steps(run_id))


def test_deadline_dead_letters_waiting_child_node_and_cancels_child_in_same_transaction(
    env: TestEnv,
):
    run_id = env.client.submit(parent, {}, run_deadline=timedelta(minutes=10))
    env.run_until_idle()
    child_row = env.conn.execute(
        "SELECT id, deadline_at, state FROM cyclone_runs WHERE parent_run_id = %s", (run_id,)
    ).fetchone()
    assert child_row is not None and child_row["state"] == "running"
    # A child run has no deadline of its own.
    assert child_row["deadline_at"] is None
    assert env.client.get_run(str(child_row["id"])).input == {"id": 7}
    env.advance_time(timedelta(minutes=11))
    # One sweep, one transaction: the parent fails and the child is cancelled together.
    assert engine.sweep_deadlines(env.conn, now=env.now()) == 1
    ship_step = next(s for s in env.client.steps(run_id) if s.node == "ship")
    assert (ship_step.state, ship_step.error_kind) == (StepState.DEAD, ErrorKind.DEADLINE)
    child = env.client.get_run(str(child_row["id"]))
    assert child.state == RunState.CANCELLED
    assert all(s.state == StepState.DISCARDED for s in env.client.steps(child.id))
    assert all(s.error_kind == ErrorKind.CANCELLED for s in env.client.steps(child.id))


def test_child_node_max_wait_limits_the_wait_for_the_child(env: TestEnv):
    slow_parent = cyclone.Workflow("seed-slow-parent")
    slow_parent.child("ship", shipping, max_wait=timedelta(minutes=5))
    run_id = env.client.submit(slow_parent, {})
    env.run_until_idle()
    env.advance_time(timedelta(minutes=6))
    st = env.run_until_complete(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.MAX_WAIT)
    child = env.conn.execute(
        "SELECT state FROM cyclone_runs WHERE parent_run_id = %s", (run_id,)
    ).fetchone()
    assert child["state"] == "cancelled"


def test_a_paused_run_keeps_its_time_left(env: TestEnv):
    run_id = env.client.submit(parks, {}, run_deadline=timedelta(minutes=30))
    env.run_until_idle()
    env.advance_time(timedelta(minutes=10))  # 20 minutes left
    assert env.client.pause(run_id)
    paused = env.client.get_run(run_id)
    left_at_pause = paused.deadline_at - paused.paused_at
    env.advance_time(timedelta(hours=3))  # far past the original deadline
    assert engine.sweep_deadlines(env.conn, now=env.now()) == 0
    assert env.client.get_run(run_id).state == RunState.PAUSED
    resumed_at = env.now()
    assert env.client.resume(run_id)
    st = env.client.get_run(run_id)
    assert st.state == RunState.RUNNING
    assert abs((st.deadline_at - resumed_at) - left_at_pause) < timedelta(seconds=1)
    assert abs(left_at_pause - timedelta(minutes=20)) < timedelta(seconds=1)
    env.advance_time(timedelta(minutes=19))
    assert env.scan() == 0
    env.advance_time(timedelta(minutes=2))
    st = env.run_until_complete(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.DEADLINE)


def test_deadline_fires_while_a_step_runs_and_the_worker_heartbeat_learns_it(env: TestEnv):
    run_id = env.client.submit(parks, {}, run_deadline=timedelta(seconds=30))
    lease = engine.lease_step(env.conn, worker="w", now=env.now())
    assert lease.kill_after is not None and 0 < lease.kill_after <= 30
    env.advance_time(timedelta(seconds=31))
    env.scan()
    revoked = engine.revoked_leases(env.conn, {lease.step_id: lease.token})
    assert revoked == {lease.step_id: "deadline"}
    assert env.client.get_run(run_id).error_kind == ErrorKind.DEADLINE

"""Workflow features end to end through the engine: fan-out, waits, sleeps, children, retries."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from datetime import timedelta

import psycopg
import pytest

import cyclone
from cyclone import ErrorKind, RunState, StepState, engine
from cyclone.db import connect, step_cursor
from cyclone.testing import TestEnv

two_tasks = cyclone.Workflow("wf-two-tasks")


@two_tasks.task()
def first(ctx):
    return 1


@two_tasks.task(after=[first])
def second(ctx):
    return 2


def test_results_flow_downstream_and_sink_outputs_form_the_run_output(env: TestEnv):
    wf = cyclone.Workflow("wf-diamond")

    @wf.task()
    def start(ctx):
        return ctx.input["n"]

    @wf.task(after=[start])
    def left(ctx):
        return ctx.results["start"] + 1

    @wf.task(after=["start"])
    def right(ctx):
        return ctx.results["start"] * 10

    @wf.task(after=[left, right])
    def join(ctx):
        return ctx.results["left"] + ctx.results["right"]

    @wf.task(after=[start])
    def side(ctx):
        return "side"

    st = env.run_until_complete(env.client.submit(wf, {"n": 2}))
    assert st.state == RunState.COMPLETED
    assert st.output == {"join": 23, "side": "side"}


def test_map_fans_out_one_step_per_item_and_collects_outputs_in_order(env: TestEnv):
    wf = cyclone.Workflow("wf-map")

    @wf.task()
    def reserve(ctx):
        return {"items": ctx.input["items"]}

    @wf.map(after=[reserve], items=lambda ctx: ctx.results["reserve"]["items"])
    def notify(ctx):
        return ctx.item * 2

    run_id = env.client.submit(wf, {"items": [3, 1, 2]})
    st = env.run_until_complete(run_id)
    assert st.output == {"notify": [6, 2, 4]}
    items = [s for s in env.client.steps(run_id) if s.node == "notify"]
    assert sorted(s.item_index for s in items) == [0, 1, 2]


def test_map_with_no_items_completes_with_an_empty_list(env: TestEnv):
    wf = cyclone.Workflow("wf-map-empty")

    @wf.map(items=lambda ctx: [])
    def each(ctx):
        raise AssertionError("never called")

    @wf.task(after=[each])
    def after(ctx):
        return ctx.results["each"]

    assert env.run_until_complete(env.client.submit(wf, {})).output == {"after": []}


def test_signal_sent_before_the_wait_is_reached_is_kept_and_consumed(env: TestEnv):
    wf = cyclone.Workflow("wf-early-signal")

    @wf.task()
    def first(ctx):
        return 1

    wf.wait("approval", signal="approved", after=[first])

    @wf.task(after=["approval"])
    def last(ctx):
        return ctx.results["approval"]

    run_id = env.client.submit(wf, {})
    assert env.client.signal(run_id, "approved", {"by": "ops"}) is True
    st = env.run_until_complete(run_id)
    assert st.output == {"last": {"by": "ops"}}


def test_signal_completes_a_waiting_node_and_run_until_complete_explains_a_stuck_run(
    env: TestEnv,
):
    wf = cyclone.Workflow("wf-wait")
    wf.wait("approval", signal="approved")
    run_id = env.client.submit(wf, {})
    with pytest.raises(cyclone.RunStuck, match="approval"):
        env.run_until_complete(run_id)
    env.client.signal(run_id, "approved", "yes")
    assert env.run_until_complete(run_id).output == {"approval": "yes"}
    assert env.client.signal(run_id, "approved", "again") is False


def test_wait_past_max_wait_is_dead_lettered(env: TestEnv):
    wf = cyclone.Workflow("wf-max-wait")
    wf.wait("approval", max_wait=timedelta(hours=2))
    run_id = env.client.submit(wf, {})
    st = env.run_until_complete(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.MAX_WAIT)


def test_sleep_wakes_on_the_database_clock(env: TestEnv):
    wf = cyclone.Workflow("wf-sleep")

    @wf.task()
    def a(ctx):
        return 1

    wf.sleep("cool-off", timedelta(minutes=5), after=[a])

    @wf.task(after=["cool-off"])
    def b(ctx):
        return 2

    run_id = env.client.submit(wf, {})
    env.run_until_idle()
    assert env.client.get_run(run_id).state == RunState.RUNNING
    env.advance_time(timedelta(minutes=4))
    env.run_until_idle()
    assert {s.node: s.state for s in env.client.steps(run_id)}["cool-off"] == StepState.WAITING
    env.advance_time(timedelta(minutes=2))
    env.run_until_idle()
    assert env.client.get_run(run_id).output == {"b": 2}


def test_child_run_output_becomes_the_child_node_output(env: TestEnv):
    child = cyclone.Workflow("wf-child")

    @child.task()
    def double(ctx):
        return ctx.input["x"] * 2

    parent = cyclone.Workflow("wf-parent")
    parent.child("kid", child, input={"x": 21})

    run_id = env.client.submit(parent, {})
    st = env.run_until_complete(run_id)
    assert st.output == {"kid": {"double": 42}}


def test_failed_child_run_dead_letters_the_child_node_as_child_failed(env: TestEnv):
    child = cyclone.Workflow("wf-bad-child")

    @child.task(max_attempts=1)
    def boom(ctx):
        raise cyclone.PermanentError("no stock")

    parent = cyclone.Workflow("wf-bad-parent")
    parent.child("kid", child)
    st = env.run_until_complete(env.client.submit(parent, {}))
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.CHILD_FAILED)
    assert "no stock" in st.error


def test_cancelling_a_child_run_fails_its_parent_node(env: TestEnv):
    child = cyclone.Workflow("wf-waiting-child")
    child.wait("forever")
    parent = cyclone.Workflow("wf-cancel-parent")
    parent.child("kid", child)
    run_id = env.client.submit(parent, {})
    env.run_until_idle()
    child_id = next(
        str(r["id"])
        for r in env.conn.execute("SELECT id FROM cyclone_runs WHERE parent_run_id IS NOT NULL")
    )
    assert env.client.cancel(child_id) is True
    st = env.client.get_run(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.CHILD_FAILED)


def test_failed_attempts_are_retried_with_backoff_until_they_succeed(env: TestEnv):
    wf = cyclone.Workflow("wf-retry")

    @wf.task(max_attempts=3)
    def flaky(ctx):
        if ctx.attempt < 3:
            raise ConnectionError(f"attempt {ctx.attempt}")
        return ctx.attempt

    run_id = env.client.submit(wf, {})
    env.run_until_idle()
    step = env.client.steps(run_id)[0]
    assert (step.state, step.attempt, step.error_kind) == (StepState.AVAILABLE, 1, "error")
    assert "attempt 1" in step.error
    st = env.run_until_complete(run_id)
    assert st.output == {"flaky": 3}


def test_exhausted_attempts_dead_letter_the_step_and_fail_the_run(env: TestEnv):
    wf = cyclone.Workflow("wf-exhaust")

    @wf.task(max_attempts=2)
    def always(ctx):
        raise ValueError("nope")

    @wf.task()
    def other(ctx):
        return "other"

    run_id = env.client.submit(wf, {})
    st = env.run_until_complete(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.ERROR)
    dead = env.client.exhausted(cyclone.ExhaustedQuery(workflow="wf-exhaust"))
    assert [(s.node, s.attempt) for s in dead] == [("always", 2)]


def test_permanent_error_dead_letters_at_once(env: TestEnv):
    wf = cyclone.Workflow("wf-permanent")

    @wf.task(max_attempts=5)
    def refuse(ctx):
        raise cyclone.PermanentError("card declined")

    run_id = env.client.submit(wf, {})
    env.run_until_idle()
    step = env.client.steps(run_id)[0]
    assert (step.state, step.attempt) == (StepState.DEAD, 1)


def test_async_handlers_run_and_are_cancelled_through_ctx_done(env: TestEnv):
    wf = cyclone.Workflow("wf-async")

    @wf.task()
    async def fetch(ctx):
        await asyncio.sleep(0)
        return {"async": True, "left": ctx.time_left() is not None}

    st = env.run_until_complete(env.client.submit(wf, {}, run_deadline=60))
    assert st.output == {"fetch": {"async": True, "left": True}}


def test_expired_lease_is_reclaimed_and_retried_as_lease_expired(env: TestEnv):
    wf = cyclone.Workflow("wf-lost-host")

    @wf.task(max_attempts=2)
    def work(ctx):
        return ctx.attempt

    run_id = env.client.submit(wf, {})
    lease = engine.lease_step(env.conn, worker="gone", lease_ttl=10, now=env.now())
    env.advance_time(timedelta(seconds=11))
    assert engine.sweep_expired_leases(env.conn, now=env.now()) == 1
    step = env.client.steps(run_id)[0]
    assert (step.state, step.error_kind) == (StepState.AVAILABLE, ErrorKind.LEASE_EXPIRED)
    assert engine.complete_step(env.conn, lease, "late", now=env.now()) is False
    assert env.run_until_complete(run_id).output == {"work": 2}


def test_cancel_discards_live_steps_and_is_false_the_second_time(env: TestEnv):
    wf = cyclone.Workflow("wf-cancel")
    wf.wait("a")
    run_id = env.client.submit(wf, {})
    assert env.client.cancel(run_id) is True
    assert env.client.cancel(run_id) is False
    st = env.client.get_run(run_id)
    assert (st.state, st.error_kind) == (RunState.CANCELLED, ErrorKind.CANCELLED)
    assert [s.state for s in env.client.steps(run_id)] == [StepState.DISCARDED]


def test_paused_runs_are_not_leased_and_resume_lets_them_finish(env: TestEnv):
    wf = cyclone.Workflow("wf-pause")

    @wf.task()
    def only(ctx):
        return "done"

    run_id = env.client.submit(wf, {})
    assert env.client.pause(run_id) is True
    assert env.client.pause(run_id) is False
    assert env.run_until_idle() == 0
    assert env.client.resume(run_id) is True
    assert env.client.resume(run_id) is False
    assert env.run_until_complete(run_id).output == {"only": "done"}


def test_resume_moves_retry_gates_forward_by_the_pause(env: TestEnv):
    wf = cyclone.Workflow("wf-pause-retry")

    @wf.task(max_attempts=2)
    def flaky(ctx):
        if ctx.attempt == 1:
            raise RuntimeError("first")
        return "ok"

    run_id = env.client.submit(wf, {})
    env.run_until_idle()
    before = env.conn.execute("SELECT available_at FROM cyclone_steps").fetchone()["available_at"]
    env.client.pause(run_id)
    env.advance_time(timedelta(hours=1))
    env.client.resume(run_id)
    after = env.conn.execute("SELECT available_at FROM cyclone_steps").fetchone()["available_at"]
    assert abs((after - before) - timedelta(hours=1)) < timedelta(seconds=1)


def test_idempotency_key_returns_the_first_run_and_writes_nothing(env: TestEnv):
    wf = cyclone.Workflow("wf-key")
    wf.wait("w")
    first = env.client.submit(wf, {"a": 1}, key="order-7")
    second = env.client.submit(wf, {"a": 2}, key="order-7")
    assert first == second
    count = env.conn.execute("SELECT count(*) AS n FROM cyclone_runs").fetchone()["n"]
    assert count == 1
    assert env.conn.execute("SELECT count(*) AS n FROM cyclone_steps").fetchone()["n"] == 1


def test_submit_inside_the_callers_transaction_exists_only_if_it_commits(env: TestEnv):
    wf = cyclone.Workflow("wf-tx")
    wf.wait("w")
    with psycopg.connect(env.dsn) as conn:
        kept = env.client.submit(wf, {}, conn=conn)
        conn.commit()
        dropped = env.client.submit(wf, {}, conn=conn)
        conn.rollback()
    env.client.get_run(kept)
    with pytest.raises(cyclone.RunNotFound):
        env.client.get_run(dropped)


def test_submit_by_name_works_from_a_process_that_never_imported_the_code(env: TestEnv):
    wf = cyclone.Workflow("wf-by-name")

    @wf.task()
    def hello(ctx):
        return "hi"

    env.register(wf)
    with cyclone.Client(env.dsn) as stranger:
        run_id = stranger.submit("wf-by-name", {"who": "cli"})
        ids = stranger.submit_many("wf-by-name", [{"i": i} for i in range(3)])
    assert len(set(ids)) == 3
    assert env.run_until_complete(run_id).output == {"hello": "hi"}
    assert [env.client.get_run(i).input for i in ids] == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_retention_deletes_old_finished_runs_only(env: TestEnv):
    wf = cyclone.Workflow("wf-retention")

    @wf.task()
    def t(ctx):
        return 1

    old = env.client.submit(wf, {})
    env.run_until_complete(old)
    env.advance_time(timedelta(days=8))
    live = env.client.submit(wf, {}, run_deadline=timedelta(days=30))
    assert engine.sweep_retention(env.conn, retention=7 * 86400, now=env.now()) == 1
    with pytest.raises(cyclone.RunNotFound):
        env.client.get_run(old)
    assert env.client.get_run(live).state == RunState.RUNNING


def test_release_gives_a_step_back_without_spending_an_attempt(env: TestEnv):
    wf = cyclone.Workflow("wf-release")

    @wf.task(max_attempts=1)
    def once(ctx):
        return ctx.attempt

    run_id = env.client.submit(wf, {})
    lease = engine.lease_step(env.conn, worker="w", now=env.now())
    assert engine.release_step(env.conn, lease.step_id, lease.token, now=env.now()) is True
    assert engine.release_step(env.conn, lease.step_id, lease.token, now=env.now()) is False
    step = env.client.steps(run_id)[0]
    assert (step.state, step.attempt) == (StepState.AVAILABLE, 0)
    # Given back by its holder: the lease ended, but nothing revoked it.
    revoked = engine.revoked_leases(env.conn, {lease.step_id: lease.token})
    assert revoked == {lease.step_id: engine.FINISHED}
    assert env.run_until_complete(run_id).output == {"once": 1}


def test_complete_and_lease_records_and_takes_the_next_step_in_one_statement(env: TestEnv):
    a, b = env.client.submit_many(two_tasks, [{}, {}])
    lease = engine.lease_step(env.conn, worker="w", now=env.now())
    assert (lease.run_id, lease.node) == (a, "first")
    done, nxt = engine.complete_and_lease(env.conn, lease, 1, worker="w", now=env.now())
    # The other run's first step was due; the new `second` of run a was made in the same
    # statement and is next in line after it.
    assert done and (nxt.run_id, nxt.node) == (b, "first")
    stale_done, stale_next = engine.complete_and_lease(env.conn, lease, 1, worker="w")
    assert (stale_done, stale_next) == (False, None)
    while nxt is not None:
        _, nxt = engine.complete_and_lease(env.conn, nxt, 0, worker="w", now=env.now())
    assert env.client.get_run(a).output == {"second": 0}
    assert env.client.get_run(b).output == {"second": 0}
    assert all(s.attempt == 1 for s in env.client.steps(a) + env.client.steps(b))


def test_a_cancel_racing_a_chain_completion_leaves_no_live_step(env: TestEnv):
    """The chain completion takes no run lock: the cancel's second pass must catch its insert."""
    run_id = env.client.submit(two_tasks, {})
    lease = engine.lease_step(env.conn, worker="w", now=env.now())
    with connect(env.dsn) as worker, connect(env.dsn) as canceller:
        with worker.transaction():
            assert engine.complete_step(worker, lease, 1, now=env.now())
            # The completion (and its insert of `second`) is not committed yet: the cancel
            # blocks on the completed step's row, then runs after the commit.
            result: list[bool] = []
            thread = threading.Thread(
                target=lambda: result.append(engine.cancel_run(canceller, run_id, now=env.now()))
            )
            thread.start()
            wait_for_lock_wait(env, canceller, "the cancel never waited on the step")
        thread.join(10)
    assert not thread.is_alive() and result == [True]
    steps = {s.node: s for s in env.client.steps(run_id)}
    assert steps["first"].state == StepState.COMPLETED
    assert (steps["second"].state, steps["second"].error_kind) == (
        StepState.DISCARDED,
        ErrorKind.CANCELLED,
    )
    assert env.client.get_run(run_id).state == RunState.CANCELLED


one_task = cyclone.Workflow("wf-one-task")


@one_task.task()
def only(ctx):
    return 1


def wait_for_lock_wait(env: TestEnv, conn: psycopg.Connection, what: str) -> None:
    """Poll until `conn`'s session waits for a lock (10 s at most)."""
    blocked = (
        "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid = %s"
    )
    deadline = time.monotonic() + 10
    while env.conn.execute(blocked, (conn.info.backend_pid,)).fetchone()["n"] == 0:
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _complete_while_blocked(env: TestEnv, lease, hold: str, param, probe: str, probe_param):
    """Run complete_and_lease on its own connection while another session holds `hold` (rows
    locked FOR UPDATE); return (whether a third session could lock the available steps that
    `probe` selects, with NOWAIT, while the completion waited; the completion's result)."""
    with connect(env.dsn) as worker, connect(env.dsn) as holder, connect(env.dsn) as other:
        result: list = []
        with holder.transaction():
            holder.execute(hold, (param,))
            thread = threading.Thread(target=lambda: result.append(
                engine.complete_and_lease(worker, lease, 1, worker="w", now=env.now())
            ))  # fmt: skip
            thread.start()
            wait_for_lock_wait(env, worker, "the completion never waited")
            try:
                with other.transaction():
                    other.execute(probe + " FOR UPDATE NOWAIT", (probe_param,)).fetchall()
                free = True
            except psycopg.errors.LockNotAvailable:
                free = False
        thread.join(10)
    assert not thread.is_alive() and len(result) == 1
    return free, result[0]


OTHER_RUNS_STEPS = "SELECT id FROM cyclone_steps WHERE run_id <> %s AND state = 'available'"


def test_a_completion_that_waits_for_its_run_holds_no_other_step(env: TestEnv):
    """The run's lock comes first, as in every writer: while a completion waits for it, the
    next step it will lease is still free (no step held while waiting for a run)."""
    a, b = env.client.submit_many(one_task, [{}, {}])
    lease = engine.lease_step(env.conn, worker="w", now=env.now())
    assert lease.run_id == a
    free, (done, nxt) = _complete_while_blocked(
        env, lease, "SELECT 1 FROM cyclone_runs WHERE id = %s FOR UPDATE", a,
        OTHER_RUNS_STEPS, a,
    )  # fmt: skip
    assert free
    assert done and (nxt.run_id, nxt.node) == (b, "only")


def test_a_chain_completion_picks_its_next_step_before_it_writes(env: TestEnv):
    """The candidate is locked while the statement's snapshot is fresh, before the completion
    writes (fewer candidates that others leased meanwhile); it is leased only after it."""
    a, b = env.client.submit_many(two_tasks, [{}, {}])
    lease = engine.lease_step(env.conn, worker="w", now=env.now())
    assert (lease.run_id, lease.node) == (a, "first")
    free, (done, nxt) = _complete_while_blocked(
        env, lease, "SELECT 1 FROM cyclone_steps WHERE id = %s FOR UPDATE", lease.step_id,
        OTHER_RUNS_STEPS, a,
    )  # fmt: skip
    assert not free
    assert done and (nxt.run_id, nxt.node) == (b, "first")


branches = cyclone.Workflow("wf-branches")


@branches.task()
def head(ctx):
    return 1


@branches.task(after=[head])
def tail(ctx):
    return 2


@branches.task()
def aside(ctx):
    return 3


def test_a_chain_completion_never_picks_a_step_of_its_own_run(env: TestEnv):
    """A cancel holds the run and takes its steps one by one: had the completion (waiting on
    its own step) picked the run's other available step, each would wait for the other."""
    a, b = env.client.submit_many(branches, [{}, {}])
    lease = engine.lease_step(env.conn, worker="w", now=env.now())
    assert (lease.run_id, lease.node) == (a, "head")
    same_run = "SELECT id FROM cyclone_steps WHERE run_id = %s AND state = 'available'"
    free, (done, nxt) = _complete_while_blocked(
        env, lease, "SELECT 1 FROM cyclone_steps WHERE id = %s FOR UPDATE", lease.step_id,
        same_run, a,
    )  # fmt: skip
    assert free  # run a's `aside` was due first, yet left alone
    assert done and nxt.run_id == b


def test_each_connection_reuses_one_cursor_for_its_per_step_statements(env: TestEnv):
    first = step_cursor(env.conn)
    assert step_cursor(env.conn) is first
    other = connect(env.dsn)
    assert step_cursor(other) is not first
    other.close()
    gone = weakref.ref(other)
    del other
    gc.collect()
    assert gone() is None  # the reused cursor does not keep its connection alive
    first.close()  # someone closed it: the next step gets a fresh one, not an error
    replaced = step_cursor(env.conn)
    assert replaced is not first and not replaced.closed
    env.register(two_tasks)
    run_id = env.client.submit(two_tasks, {})
    assert env.run_until_complete(run_id).state == RunState.COMPLETED

"""Flow control, part one: priorities, queues, fair leasing between workflows and within a
backlog, and the map fan-out cap (docs/flow-control.md)."""

from __future__ import annotations

import pytest

import cyclone
from cyclone import engine
from cyclone.errors import GraphError
from cyclone.states import ErrorKind, RunState, StepState
from cyclone.testing import TestEnv

bulk = cyclone.Workflow("fc-bulk")
other = cyclone.Workflow("fc-other")
urgent = cyclone.Workflow("fc-urgent", queue="fc-fast", priority=1)
fan = cyclone.Workflow("fc-fan")
capped = cyclone.Workflow("fc-capped")


@bulk.task()
def work(ctx):
    return None


@other.task()
def single(ctx):
    return None


@urgent.task()
def now(ctx):
    return None


@fan.map(items=lambda ctx: list(range(150)))
def each(ctx):
    return ctx.item


@capped.map(items=lambda ctx: list(range(5)), max_items=3)
def few(ctx):
    return ctx.item


ALL = [bulk, other, urgent, fan, capped]


@pytest.fixture(autouse=True)
def every_lease_from_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order under test is the index's; a lease's starting point is tested in
    test_plans.py (with it, a step behind the point waits FULL_SCAN_EVERY at most)."""
    monkeypatch.setattr(engine.steps, "FULL_SCAN_EVERY", 0.0)


def lease_runs(env: TestEnv, n: int, workflows: list[str] | None = None) -> list[str]:
    """The runs of the next n steps leased (and completed, as a worker would)."""
    names = workflows or [wf.name for wf in ALL]
    out = []
    for _ in range(n):
        lease = engine.lease_step(env.conn, worker="fc", workflows=names)
        assert lease is not None
        out.append(lease.run_id)
        if not lease.is_fanout:
            assert engine.complete_step(env.conn, lease, None)
        else:
            assert engine.expand_map(env.conn, lease, list(range(150)))
    return out


def test_a_lower_priority_number_is_leased_first_and_ties_keep_submit_order(env: TestEnv):
    env.register(*ALL)
    first = env.client.submit_many(bulk, [None] * 3)
    late_urgent = env.client.submit(bulk, None, priority=1)
    last = env.client.submit(bulk, None, priority=5)
    assert lease_runs(env, 5) == [late_urgent, *first, last]


def test_a_workflow_gives_its_priority_and_queue_to_its_runs_unless_the_submit_says(
    env: TestEnv,
):
    env.register(*ALL)
    default = env.client.submit(urgent, None)
    lowered = env.client.submit(urgent, None, priority=4)
    rows = {
        str(r["id"]): r
        for r in env.conn.execute("SELECT id, queue, priority FROM cyclone_runs").fetchall()
    }
    assert (rows[default]["queue"], rows[default]["priority"]) == ("fc-fast", 1)
    assert (rows[lowered]["queue"], rows[lowered]["priority"]) == ("fc-fast", 4)
    steps = env.conn.execute("SELECT DISTINCT priority FROM cyclone_steps ORDER BY 1").fetchall()
    assert [s["priority"] for s in steps] == [1, 4]
    queues = env.conn.execute("SELECT name FROM cyclone_queues ORDER BY name").fetchall()
    assert {"default", "fc-fast"} <= {q["name"] for q in queues}


@pytest.mark.parametrize("bad", [0, 6, -1, 2.5, True, "1"])
def test_a_bad_priority_is_refused_and_writes_nothing(env: TestEnv, bad: object):
    env.register(*ALL)
    with pytest.raises(ValueError, match="priority: expected an integer from 1"):
        env.client.submit(bulk, None, priority=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority"):
        env.client.submit_many(bulk, [None], priority=bad)  # type: ignore[arg-type]
    with pytest.raises(GraphError, match="priority"):
        cyclone.Workflow("fc-bad", priority=bad)  # type: ignore[arg-type]
    assert env.conn.execute("SELECT count(*) AS n FROM cyclone_runs").fetchone()["n"] == 0


def test_a_run_of_another_workflow_starts_within_a_few_steps_of_a_big_backlog(env: TestEnv):
    env.register(*ALL)
    backlog = set(env.client.submit_many(bulk, [None] * 2000))
    assert set(lease_runs(env, 10)) <= backlog
    # What a scanner does every second: the queue's clock moves to what is in service.
    env.conn.execute(
        "UPDATE cyclone_steps SET state = 'running', lease_token = gen_random_uuid(),"
        " lease_expires_at = now() + interval '1 minute'"
        " WHERE id = (SELECT id FROM cyclone_steps WHERE state = 'available'"
        "              ORDER BY priority, pass, id LIMIT 1)"
    )
    assert engine.sweep_fair_clock(env.conn) == 1
    newcomer = env.client.submit(other, None)
    # Another run of the backlog's own workflow goes behind the backlog: FIFO in a group.
    behind = env.client.submit(bulk, None)
    assert newcomer in lease_runs(env, 2)
    order = lease_runs(env, 1989, workflows=[bulk.name])
    assert order[-1] == behind


def test_a_big_fan_out_does_not_hold_back_a_run_of_another_workflow(env: TestEnv):
    env.register(*ALL)
    fanned = env.client.submit(fan, None)
    assert lease_runs(env, 1) == [fanned]  # the fan-out: 150 items now wait
    assert set(lease_runs(env, 3)) == {fanned}
    one_step = env.client.submit(other, None)
    # Items take their fan-out's pass plus their index: the run lands among the first items.
    assert one_step in lease_runs(env, 2)


def test_a_map_over_its_max_items_fails_its_step_with_a_kind_of_its_own(env: TestEnv):
    env.register(*ALL)
    run_id = env.client.submit(capped, None)
    status = env.run_until_complete(run_id)
    assert status.state == RunState.FAILED
    assert status.error_kind == ErrorKind.TOO_MANY_ITEMS
    assert "5 items, more than its max_items (3)" in (status.error or "")
    [step] = env.client.steps(run_id)
    assert step.state == StepState.DEAD and step.attempt == 1  # not retried
    assert env.conn.execute("SELECT count(*) AS n FROM cyclone_steps").fetchone()["n"] == 1


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_a_bad_max_items_is_refused_when_the_node_is_defined(bad: object):
    wf = cyclone.Workflow("fc-bad-map")
    with pytest.raises(GraphError, match="node 'm': max_items: expected an integer >= 1"):
        wf.map(items=lambda ctx: [], max_items=bad, name="m")(lambda ctx: None)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", " x", 7, "q" * 101])
def test_a_bad_queue_name_is_refused(bad: object):
    with pytest.raises(GraphError, match="queue: expected a name"):
        cyclone.Workflow("fc-bad-queue", queue=bad)  # type: ignore[arg-type]

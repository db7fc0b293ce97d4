"""Re-driving dead-lettered steps (engine.dlq.retry_dead_step), against a real PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest

import cyclone
from cyclone.engine.dlq import RetryRefused, retry_dead_step
from cyclone.states import ErrorKind, RunState, StepState
from cyclone.testing import TestEnv

# Handlers fail while their switch is on; the tests flip it to let the retry succeed.
BROKEN: dict[str, bool] = {}

parks = cyclone.Workflow("dlq-parks")


@parks.task()
def prepare(ctx):
    return {"ok": True}


parks.wait("approval", signal="approved", after=[prepare], max_wait=timedelta(hours=4))
parks.sleep("cool-off", timedelta(minutes=5), after=["approval"])


@parks.task(after=["cool-off"])
def ship(ctx):
    return "shipped"


branches = cyclone.Workflow("dlq-branches")


@branches.task()
def start(ctx):
    return [1, 2, 3]


@branches.map(after=[start], items=lambda ctx: ctx.results["start"])
def each(ctx):
    if ctx.item == 2 and BROKEN.get("each"):
        raise cyclone.PermanentError("item 2 is broken")
    return ctx.item * 10


branches.wait("gate", signal="go", after=[start], max_wait=timedelta(hours=1))


@branches.task(after=[each, "gate"])
def finish(ctx):
    return sum(ctx.results["each"])


label = cyclone.Workflow("dlq-label")


@label.task(max_attempts=1)
def print_label(ctx):
    if BROKEN.get("label"):
        raise RuntimeError("printer on fire")
    return "PKG-1"


shipper = cyclone.Workflow("dlq-shipper")


@shipper.task()
def pack(ctx):
    return {"box": 1}


shipper.child("labelled", label, after=[pack])


@pytest.fixture(autouse=True)
def _reset_switches():
    BROKEN.clear()
    yield
    BROKEN.clear()


def dead(env: TestEnv, run_id: str) -> list[cyclone.StepInfo]:
    return [s for s in env.client.steps(run_id) if s.state == StepState.DEAD]


def deadline_killed(env: TestEnv) -> str:
    run_id = env.client.submit(parks, {}, run_deadline=timedelta(hours=1))
    env.run_until_idle()
    env.advance_time(timedelta(hours=2))
    st = env.run_until_complete(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.DEADLINE)
    return run_id


def test_a_run_failed_by_its_deadline_refuses_a_retry_without_a_new_deadline(env: TestEnv):
    env.register(parks)
    run_id = deadline_killed(env)
    [step] = dead(env, run_id)
    with pytest.raises(RetryRefused, match="deadline"):
        retry_dead_step(env.conn, step.id, now=env.now())
    assert env.client.get_run(run_id).state == RunState.FAILED
    assert [s.id for s in dead(env, run_id)] == [step.id]


def test_a_deadline_retry_gets_a_new_deadline_and_the_run_completes(env: TestEnv):
    env.register(parks)
    run_id = deadline_killed(env)
    [step] = dead(env, run_id)
    done = retry_dead_step(env.conn, step.id, deadline=3600, now=env.now())
    assert done.run_id == run_id and done.step_ids == (step.id,)
    assert abs((done.deadline_at - env.now()).total_seconds() - 3600) < 5
    st = env.client.get_run(run_id)
    assert (st.state, st.finished_at, st.error_kind) == (RunState.RUNNING, None, None)
    [again] = [s for s in env.client.steps(run_id) if s.id == step.id]
    assert (again.state, again.attempt, again.error, again.error_kind) == (
        StepState.WAITING,
        0,
        None,
        None,
    )
    env.client.signal(run_id, "approved", {"by": "ops"})
    st = env.run_until_complete(run_id)
    assert (st.state, st.output) == (RunState.COMPLETED, {"ship": "shipped"})


def test_every_dead_deadline_step_of_the_run_comes_back_with_it(env: TestEnv):
    fan = cyclone.Workflow("dlq-fan")

    @fan.map(items=lambda ctx: [1, 2, 3])
    def each_item(ctx):
        return ctx.item

    env.register(fan)
    run_id = env.client.submit(fan, {}, run_deadline=timedelta(minutes=1))
    # Expand the map, then let the deadline pass with all three items still available.
    assert env.run_one()
    env.advance_time(timedelta(minutes=2))
    env.scan()
    killed = dead(env, run_id)
    assert len(killed) == 3
    done = retry_dead_step(env.conn, killed[1].id, deadline=600, now=env.now())
    assert done.step_ids == tuple(s.id for s in killed)
    st = env.run_until_complete(run_id)
    assert (st.state, st.output) == (RunState.COMPLETED, {"each_item": [1, 2, 3]})


def test_discarded_steps_come_back_in_place_and_the_run_completes(env: TestEnv):
    env.register(branches)
    BROKEN["each"] = True
    run_id = env.client.submit(branches, {})
    st = env.run_until_complete(run_id)
    assert st.state == RunState.FAILED and "item 2 is broken" in st.error
    before = env.client.steps(run_id)
    assert {s.state for s in before} == {StepState.COMPLETED, StepState.DEAD, StepState.DISCARDED}
    [broken] = dead(env, run_id)

    BROKEN["each"] = False
    done = retry_dead_step(env.conn, broken.id, now=env.now())
    redriven = {s.id for s in before if s.state in (StepState.DEAD, StepState.DISCARDED)}
    assert set(done.step_ids) == redriven
    after = {s.id: s for s in env.client.steps(run_id)}
    assert set(after) == {s.id for s in before}  # same rows: no duplicate node instances
    assert after[broken.id].state == StepState.AVAILABLE and after[broken.id].attempt == 0
    gate = next(s for s in after.values() if s.node == "gate")
    assert gate.state == StepState.WAITING

    env.client.signal(run_id, "go")
    st = env.run_until_complete(run_id)
    assert (st.state, st.output) == (RunState.COMPLETED, {"finish": 60})
    rows = env.conn.execute(
        "SELECT node, item_index, count(*) AS n FROM cyclone_steps WHERE run_id = %s"
        " GROUP BY 1, 2 HAVING count(*) > 1",
        (run_id,),
    ).fetchall()
    assert rows == []


def test_a_dead_child_node_starts_a_new_child_run(env: TestEnv):
    env.register(shipper)
    BROKEN["label"] = True
    run_id = env.client.submit(shipper, {})
    st = env.run_until_complete(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.CHILD_FAILED)
    [child_node] = dead(env, run_id)
    old_child = env.conn.execute(
        "SELECT id FROM cyclone_runs WHERE parent_run_id = %s", (run_id,)
    ).fetchone()["id"]
    [child_step] = dead(env, str(old_child))
    # The child run's own step cannot be retried: its parent has ended.
    with pytest.raises(RetryRefused, match="parent"):
        retry_dead_step(env.conn, child_step.id, now=env.now())

    BROKEN["label"] = False
    retry_dead_step(env.conn, child_node.id, now=env.now())
    st = env.run_until_complete(run_id)
    assert st.state == RunState.COMPLETED
    assert st.output == {"labelled": {"print_label": "PKG-1"}}
    children = env.conn.execute(
        "SELECT state FROM cyclone_runs WHERE parent_run_id = %s ORDER BY created_at", (run_id,)
    ).fetchall()
    assert [c["state"] for c in children] == ["failed", "completed"]


def test_a_step_that_is_not_dead_or_does_not_exist_is_refused_and_nothing_changes(
    env: TestEnv,
):
    env.register(branches)
    BROKEN["each"] = True
    run_id = env.client.submit(branches, {})
    env.run_until_complete(run_id)
    done = next(s for s in env.client.steps(run_id) if s.state == StepState.COMPLETED)
    with pytest.raises(RetryRefused, match="completed, not dead"):
        retry_dead_step(env.conn, done.id)
    with pytest.raises(cyclone.StepNotFound):
        retry_dead_step(env.conn, 10**12)
    for bad in (0, -1, True, "7", 2**63):
        with pytest.raises(cyclone.StepNotFound):
            retry_dead_step(env.conn, bad)  # type: ignore[arg-type]
    [broken] = dead(env, run_id)
    with pytest.raises(ValueError, match="deadline"):
        retry_dead_step(env.conn, broken.id, deadline=0)
    assert env.client.get_run(run_id).state == RunState.FAILED


def test_a_second_retry_of_the_same_step_is_refused(env: TestEnv):
    env.register(branches)
    BROKEN["each"] = True
    run_id = env.client.submit(branches, {})
    env.run_until_complete(run_id)
    [broken] = dead(env, run_id)
    retry_dead_step(env.conn, broken.id)
    with pytest.raises(RetryRefused, match="not dead"):
        retry_dead_step(env.conn, broken.id)


def test_a_child_run_cannot_get_a_deadline_of_its_own(env: TestEnv):
    env.register(shipper)
    BROKEN["label"] = True
    run_id = env.client.submit(shipper, {})
    env.run_until_idle()
    child = env.conn.execute(
        "SELECT id FROM cyclone_runs WHERE parent_run_id = %s", (run_id,)
    ).fetchone()["id"]
    # Make the parent live again by hand so only the deadline rule is left to refuse.
    env.conn.execute(
        "UPDATE cyclone_runs SET state = 'running', finished_at = NULL WHERE id = %s", (run_id,)
    )
    [child_step] = dead(env, str(child))
    with pytest.raises(RetryRefused, match="no deadline of its own"):
        retry_dead_step(env.conn, child_step.id, deadline=60)


synced = cyclone.Workflow("dlq-synced", concurrency=cyclone.Concurrency(key="account", limit=1))


@synced.task(max_attempts=1)
def sync(ctx):
    if BROKEN.get(ctx.input["account"]):
        raise RuntimeError("remote down")
    return None


def test_a_keyed_runs_retry_is_refused_while_its_key_is_full_and_taken_once_it_frees(
    env: TestEnv,
):
    """A re-driven run takes a slot of its key: it may not run beside the key's limit."""
    env.register(synced)
    BROKEN["a"] = True
    failed = env.client.submit(synced, {"account": "a"})
    assert env.run_until_complete(failed).state == RunState.FAILED
    BROKEN.clear()
    busy = env.client.submit(synced, {"account": "a"})  # holds the key's one slot
    other = env.client.submit(synced, {"account": "b"})  # another key: no matter
    [broken] = dead(env, failed)
    with pytest.raises(RetryRefused, match=r"key 'a' of workflow dlq-synced has 1 active run"):
        retry_dead_step(env.conn, broken.id)
    assert env.client.get_run(failed).state == RunState.FAILED  # nothing changed
    env.run_until_complete(busy)
    env.run_until_complete(other)
    retry_dead_step(env.conn, broken.id)
    assert env.run_until_complete(failed).state == RunState.COMPLETED

"""The supervisor's one statement for its workers: completions and leases for many at once."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cyclone
from cyclone.engine.dispatch import Dispatched, dispatch, finished_of, lease_of
from cyclone.engine.steps import lease_step
from cyclone.testing import TestEnv

pair = cyclone.Workflow("dispatch-pair")


@pair.task()
def first(ctx):
    return 1


@pair.task(after=[first])
def second(ctx):
    return 2


single = cyclone.Workflow("dispatch-single")


@single.task()
def only(ctx):
    return "only"


joined = cyclone.Workflow("dispatch-join")


@joined.task()
def left(ctx):
    return 1


@joined.task()
def right(ctx):
    return 2


@joined.task(after=[left, right])
def both(ctx):
    return 3


NAMES = [pair.name, single.name, joined.name]


@pytest.fixture
def denv(env: TestEnv) -> TestEnv:
    env.register(pair, single, joined)
    return env


def leases_of(result: Dispatched) -> list:
    return [lease_of(row, 30.0) for _, row in sorted(result.leases.items())]


def test_one_statement_leases_a_step_for_each_waiting_worker(denv) -> None:
    runs = [denv.client.submit(single, {"n": i}) for i in range(3)]
    result = dispatch(denv.conn, [], ["host:1", "host:2"], workflows=NAMES)
    assert result.completed == frozenset()
    assert sorted(result.leases) == [0, 1]
    leases = leases_of(result)
    # Oldest first, each with its run's input, one worker each.
    assert [lease.run_id for lease in leases] == runs[:2]
    assert [lease.input for lease in leases] == [{"n": 0}, {"n": 1}]
    holders = denv.conn.execute(
        "SELECT leased_by FROM cyclone_steps WHERE state = 'running' ORDER BY id"
    ).fetchall()
    assert [row["leased_by"] for row in holders] == ["host:1", "host:2"]


def test_finished_tasks_complete_make_their_next_steps_and_end_their_runs(denv) -> None:
    chained = denv.client.submit(pair, None)
    ending = denv.client.submit(single, None)
    leases = leases_of(dispatch(denv.conn, [], ["w:1", "w:2"], workflows=NAMES))
    finished = [finished_of(denv.conn, lease, {"from": lease.node}) for lease in leases]
    assert all(f is not None for f in finished)
    result = dispatch(denv.conn, finished, ["w:1", "w:2"], workflows=NAMES)
    assert result.completed == {lease.step_id for lease in leases}
    # The chain's next step was made, and leased once its statement committed.
    assert [lease.node for lease in leases_of(result)] == ["second"]
    assert denv.client.get_run(ending).state == "completed"
    assert denv.client.get_run(ending).output == {"only": {"from": "only"}}
    assert denv.client.get_run(chained).state == "running"


def test_a_finished_task_whose_lease_was_lost_changes_nothing(denv) -> None:
    run_id = denv.client.submit(pair, None)
    (lease,) = leases_of(dispatch(denv.conn, [], ["w:1"], workflows=NAMES))
    denv.client.cancel(run_id)
    finished = finished_of(denv.conn, lease, 1)
    result = dispatch(denv.conn, [finished], [], workflows=NAMES)
    assert result.completed == frozenset()
    nodes = denv.conn.execute(
        "SELECT node FROM cyclone_steps WHERE run_id = %s", (run_id,)
    ).fetchall()
    assert [row["node"] for row in nodes] == ["first"]  # no `second` made behind the fence


def test_only_tasks_the_one_statement_can_complete_are_handed_over(denv) -> None:
    denv.client.submit(joined, None)
    leases = leases_of(dispatch(denv.conn, [], ["w:1", "w:2"], workflows=NAMES))
    assert {lease.node for lease in leases} == {"left", "right"}
    # Their successor joins both: completing either needs the general path.
    assert [finished_of(denv.conn, lease, 1) for lease in leases] == [None, None]


def test_workers_beyond_the_steps_due_get_nothing_and_nothing_is_leased_twice(denv) -> None:
    denv.client.submit(single, None)
    result = dispatch(denv.conn, [], ["w:1", "w:2", "w:3"], workflows=NAMES)
    assert len(result.leases) == 1
    assert lease_step(denv.conn, worker="other", workflows=NAMES) is None
    assert dispatch(denv.conn, [], ["w:4"], workflows=NAMES).leases == {}


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shapes=st.lists(st.sampled_from(["pair", "single"]), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_batches_of_any_make_drain_every_run_each_step_once(pg_dsn, shapes, seed) -> None:
    """Workers finishing and asking in random batches, some finishing without asking again,
    some asking without having finished: every run completes, every step exactly once."""
    rnd = random.Random(seed)
    with TestEnv([pair, single], dsn=pg_dsn) as env:
        for shape in shapes:
            env.client.submit(pair if shape == "pair" else single, None)
        holding: dict[str, object] = {}  # worker name -> its lease
        for _ in range(200):
            names = [f"w:{i}" for i in range(4)]
            done = [w for w in names if w in holding and rnd.random() < 0.7]
            finished = [finished_of(env.conn, holding.pop(w), w) for w in done]
            asking = [w for w in names if w not in holding and rnd.random() < 0.8]
            result = dispatch(env.conn, finished, asking, workflows=NAMES)
            assert result.completed == {f.step_id for f in finished}
            for slot, row in result.leases.items():
                holding[asking[slot]] = lease_of(row, 30.0)
            if (
                not holding
                and env.conn.execute(
                    "SELECT 1 FROM cyclone_runs WHERE state <> 'completed'"
                ).fetchone()
                is None
            ):
                break
        counts = env.conn.execute(
            "SELECT count(*) AS runs, count(*) FILTER (WHERE state = 'completed') AS done"
            " FROM cyclone_runs"
        ).fetchone()
        assert counts == {"runs": len(shapes), "done": len(shapes)}
        steps = env.conn.execute(
            "SELECT count(*) AS n, count(*) FILTER (WHERE attempt = 1 AND state = 'completed')"
            " AS once FROM cyclone_steps"
        ).fetchone()
        assert steps["n"] == steps["once"] == sum(2 if s == "pair" else 1 for s in shapes)

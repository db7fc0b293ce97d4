"""Flow control's statements cost the same whatever the backlog behind a limit, the dead
entries a drain leaves behind, and the statistics.

A node limited to 64 at once (its steps wait for a slot as available ones, in
cyclone_steps_limited_ready_idx: migration 33) holds a backlog of thousands, beside a backlog of
another workflow's steps and thousands of steps of a rate-limited node held for a token. Each
statement is explained with its custom and its generic plans (the statements inside the
functions follow plan_cache_mode as well, but those of the PL/pgSQL picks, always generic since
migration 34) in the four statistics states of test_plans.py, in a transaction rolled back:

* a lease, one step's (step_lease) and the supervisor's (steps_dispatch), while every slot of
  the node is taken: the node's backlog is not read, the other workflow's steps are leased;
* the supervisor's lease while the node has free slots: it reads and writes the steps it leases
  and their slots, not the backlog;
* an admission of held steps (cyclone_admit_steps, run by the trigger of every held step made
  and by the held_steps sweep) with tokens for a few: it reads and writes those, not the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from plan_probe import probe, probe_text

import cyclone
from cyclone import engine
from cyclone.db import text_array
from cyclone.engine.dispatch import Dispatched, Finished, dispatch, dispatch_params
from cyclone.engine.steps import FLOOR_KEYS
from cyclone.sql import QUERIES
from cyclone.testing import TestEnv

BACKLOG = 15_000
LIMIT = 64
# Steps of another workflow waiting for workers: a plan that looked for the node's steps among
# every available step would read them all.
AVAILABLE = 20_000
wide = cyclone.Workflow("pa-wide")
rated = cyclone.Workflow("pa-rated")
plain = cyclone.Workflow("pa-plain")


@wide.task(concurrency=LIMIT)
def spread(ctx):
    return None


@rated.task(rate_limit="pa-limiter")
def paced(ctx):
    return None


@plain.task()
def anything(ctx):
    return None


STATES = ["never_analyzed", "analyzed_empty", "analyzed_history", "analyzed"]
# Buffers of a lease that takes a handful of steps: the node's probe, the scans' descents, the
# rows leased, their runs, the rows written with their index entries. The backlogs are 500-odd
# pages each.
LEASE_BASE = 150
LEASE_PER_STEP = 25
# What slots add to a lease: the node's probe (its limited index, its slots), and per step its
# slot read, locked and written.
SLOT_BASE = 30
SLOT_PER_STEP = 6
ADMIT = "SELECT cyclone_admit_steps(%(workflow)s, %(node)s, coalesce(%(now)s::timestamptz, now()))"
# An admission: its fixed reads (the limiter and its bucket, the bucket's pending steps), then
# per step admitted its held entry, its row and run, and the row written with its index entries.
ADMIT_BASE = 100
ADMIT_PER_STEP = 40
TOKENS = 20


def _submit(env: TestEnv, wf: cyclone.Workflow, n: int, priority: int | None = None) -> None:
    for start in range(0, n, 5000):
        env.client.submit_many(wf, [None] * min(5000, n - start), priority=priority)


@pytest.fixture(scope="module", params=STATES)
def backlog(request: pytest.FixtureRequest, pg_dsn: str) -> Iterator[TestEnv]:
    with TestEnv(workflows=[wide, rated, plain], dsn=pg_dsn) as env:
        for table in ("cyclone_steps", "cyclone_runs", "cyclone_node_slots"):
            env.conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
        # One token an hour, none saved up: the rated steps stay held.
        env.client.set_rate_limit("pa-limiter", rate=1, per=timedelta(hours=1), burst=1)
        if request.param == "analyzed_empty":
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs, cyclone_node_slots")
        if request.param == "analyzed_history":
            # A drained history of the node: its steps ended in one statement each batch.
            for _ in range(2):
                _submit(env, wide, 5000)
                env.conn.execute(
                    "UPDATE cyclone_steps SET state = 'completed', completed_at = now(),"
                    " attempt = 1 WHERE state = 'available'"
                )
            env.conn.execute("UPDATE cyclone_runs SET state = 'completed', finished_at = now()")
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs, cyclone_node_slots")
        _submit(env, wide, BACKLOG)
        _submit(env, rated, BACKLOG)
        _submit(env, plain, AVAILABLE, priority=5)  # leased after the node's steps
        # A drain of each by the supervisor's statement: dead entries at its index's head.
        for wf in (wide, plain):
            finished: list[Any] = []
            for _ in range(10):
                done = dispatch(env.conn, finished, [f"pa:{i}" for i in range(30)],
                                workflows=[wf.name])  # fmt: skip
                finished = [Finished(r["id"], r["lease_token"], r["run_id"], None, last=True)
                            for r in done.leases.values()]  # fmt: skip
            dispatch(env.conn, finished, [], workflows=[wf.name])
        if request.param == "analyzed":
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs, cyclone_node_slots")
        yield env


def _in_use(env: TestEnv) -> int:
    row = env.conn.execute(
        "SELECT count(*) AS n FROM cyclone_node_slots WHERE workflow = %s AND step_id IS NOT NULL",
        (wide.name,),
    ).fetchone()
    return int(row["n"])


def _leased(env: TestEnv, name: str, params: dict[str, Any]) -> list[str]:
    """The workflows of the steps the statement leases, in a transaction rolled back."""
    with env.conn.transaction(force_rollback=True):
        row = env.conn.execute(QUERIES[name], params).fetchone()
    if name == "steps_dispatch":
        return [r["workflow"] for r in Dispatched.parse(row["result"]).leases.values()]
    return [row["workflow"]] if row["workflow"] is not None else []


def _lease_params(**extra: Any) -> dict[str, Any]:
    return {
        "lease": True, "other_than": None, "worker": "pa", "ttl": 30.0, "now": None,
        "workflows": text_array((wide.name, plain.name)), "graphs": None,
        **dict.fromkeys(FLOOR_KEYS), **extra,
    }  # fmt: skip


def _dispatch_params(workers: int, workflows: tuple[str, ...]) -> dict[str, Any]:
    return {
        **dispatch_params([], [f"pa:{i}" for i in range(workers)], workflows=workflows,
                          lease_ttl=30.0),
        **dict.fromkeys(FLOOR_KEYS),
    }  # fmt: skip


@pytest.fixture
def full(backlog: TestEnv) -> Iterator[TestEnv]:
    """Every slot of the node taken by a lease, given back after the test."""
    leases = []
    while lease := engine.lease_step(backlog.conn, worker="pa", workflows=[wide.name]):
        leases.append(lease)
    assert len(leases) == LIMIT == _in_use(backlog)
    try:
        yield backlog
    finally:
        for lease in leases:
            assert engine.release_step(backlog.conn, lease.step_id, lease.token)
        assert _in_use(backlog) == 0


@pytest.mark.parametrize("mode", ["custom", "generic"])
@pytest.mark.parametrize("name", ["step_lease", "steps_dispatch"])
def test_a_lease_while_every_slot_is_taken_reads_none_of_the_nodes_backlog(
    full: TestEnv, name: str, mode: str
):
    workers = 4 if name == "steps_dispatch" else 1
    params = _lease_params() if name == "step_lease" else _dispatch_params(
        workers, (wide.name, plain.name))  # fmt: skip
    assert _leased(full, name, params) == [plain.name] * workers
    probe(full.conn, name, params, mode)  # the session plans the functions' statements
    result = probe(full.conn, name, params, mode)
    assert result.buffers <= LEASE_BASE + LEASE_PER_STEP * workers, result.text


@pytest.mark.parametrize("mode", ["custom", "generic"])
def test_a_lease_of_a_node_with_free_slots_reads_and_writes_what_it_leases(
    backlog: TestEnv, mode: str
):
    """30 steps of the node leased by the supervisor's statement, with the other workflow's
    steps (of a lower priority) served too, cost at most two leases of 30 steps of no limit
    (each kind's first 30 are read and locked, then the first 30 of both are leased) and their
    slots, however long the backlogs behind them."""
    both = _dispatch_params(30, (wide.name, plain.name))
    assert _leased(backlog, "steps_dispatch", both) == [wide.name] * 30
    probe(backlog.conn, "steps_dispatch", both, mode)
    limited = probe(backlog.conn, "steps_dispatch", both, mode)
    alone = _dispatch_params(30, (plain.name,))
    assert _leased(backlog, "steps_dispatch", alone) == [plain.name] * 30
    probe(backlog.conn, "steps_dispatch", alone, mode)
    free = probe(backlog.conn, "steps_dispatch", alone, mode)
    assert _in_use(backlog) == 0  # rolled back
    assert limited.buffers <= 2 * free.buffers + SLOT_BASE + SLOT_PER_STEP * 30, (
        f"{free.buffers} buffers for 30 steps of no limit\n{limited.text}"
    )


def _held(env: TestEnv) -> int:
    row = env.conn.execute(
        "SELECT count(*) AS n FROM cyclone_steps WHERE held AND workflow = %s", (rated.name,)
    ).fetchone()
    return int(row["n"])


@pytest.mark.parametrize("mode", ["custom", "generic"])
def test_an_admission_reads_and_writes_the_steps_it_admits_not_the_backlog(
    backlog: TestEnv, mode: str
):
    """The bucket has tokens for TOKENS steps: the admission gives them, at a cost that
    follows them, whatever waits behind."""
    assert _held(backlog) > BACKLOG - 10
    params = {"workflow": rated.name, "node": "paced", "now": None}
    with backlog.conn.transaction(force_rollback=True):
        backlog.conn.execute(
            "UPDATE cyclone_rate_limits SET burst = %s WHERE name = 'pa-limiter'", (TOKENS,)
        )
        backlog.conn.execute(
            "UPDATE cyclone_rate_buckets SET tokens = %s, updated_at = now()"
            " WHERE name = 'pa-limiter'",
            (TOKENS,),
        )
        probe_text(backlog.conn, ADMIT, params, mode)
        result = probe_text(backlog.conn, ADMIT, params, mode)
    assert result.buffers <= ADMIT_BASE + ADMIT_PER_STEP * TOKENS, result.text


def test_the_lease_functions_keep_one_plan_for_each_of_their_statements(env: TestEnv):
    """Every function a lease calls pins plan_cache_mode (migration 34): in the PL/pgSQL
    picks, a custom plan looked cheaper, so each call planned the node probe anew (0.6 ms of
    planning for 0.07 ms of work, on every statement of a supervisor serving a limited node)."""
    rows = env.conn.execute(
        "SELECT p.proname, p.proconfig FROM pg_proc p"
        " WHERE p.pronamespace = current_schema()::regnamespace"
        " AND p.proname LIKE 'cyclone_lease_%%'"
    ).fetchall()
    names = {r["proname"] for r in rows}
    assert {"cyclone_lease_pick", "cyclone_lease_pick_one", "cyclone_lease_candidates"} <= names
    for row in rows:
        assert "plan_cache_mode=force_generic_plan" in (row["proconfig"] or []), row["proname"]

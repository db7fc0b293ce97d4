"""Admitting held steps (cyclone_admit_steps, run by the triggers of every step made or ended
of a limited node, and by the held_steps sweep) costs the same whatever the backlog of held
steps, the dead entries admitted and ended steps leave behind, and the statistics.

A node limited to 64 at once, with a rate limit, holds a backlog of thousands of steps, beside
a backlog of another workflow's steps available to workers. A call while 16 or more of its
steps are available (the held_steps sweep's, an insert's) looks at those 16 and stops (the
common case of a limit that does not bind); an admission reads and writes the steps it
admits, never the backlog. Each is explained with its custom and its generic plans (the statements
inside the function follow plan_cache_mode as well) in the four statistics states of
test_plans.py, in a transaction rolled back.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from plan_probe import probe_text

import cyclone
from cyclone import engine
from cyclone.engine.sweeps import sweep_held_steps
from cyclone.testing import TestEnv

HELD = 15_000
LIMIT = 64
# Steps of other workflows waiting for workers: a plan that looked for the node's available
# steps among every available step would read them all.
AVAILABLE = 20_000
wide = cyclone.Workflow("pa-wide")
plain = cyclone.Workflow("pa-plain")


@wide.task(concurrency=LIMIT, rate_limit="pa-limiter")
def spread(ctx):
    return None


@plain.task()
def anything(ctx):
    return None


ADMIT = (
    "SELECT cyclone_admit_steps(%(workflow)s, %(node)s, coalesce(%(now)s::timestamptz, now()),"
    " %(limit)s)"
)
PARAMS = {"workflow": wide.name, "node": "spread", "now": None, "limit": LIMIT}
STATES = ["never_analyzed", "analyzed_empty", "analyzed_history", "analyzed"]
# Buffers of a freed slot that finds 16 available: the descent of the slot index and the 16
# rows' pages, with room for the dead entries a drain leaves between them.
PROBE_BOUND = 40
# An admission: its fixed reads (the counts, the limiter and its bucket, and the bucket's
# pending steps: one scan of the primary key for their ids, neighbours that share its pages;
# looked up one by one, the 60-odd here cost 250 buffers more), then per step admitted its
# held entry, its row and run, and the row written with its five index entries.
# A plan that walked the held backlog's rows would read its 500-odd pages.
ADMIT_BASE = 100
ADMIT_PER_STEP = 40


def _states(env: TestEnv) -> dict[str, int]:
    rows = env.conn.execute(
        "SELECT CASE WHEN held THEN 'held' ELSE state END AS s, count(*) AS n"
        " FROM cyclone_steps WHERE workflow = %s GROUP BY 1",
        (wide.name,),
    ).fetchall()
    return {r["s"]: r["n"] for r in rows}


def _give_back(env: TestEnv, leases: list[engine.Lease]) -> None:
    """The leases released as a planned stop releases them, and the node's slots filled again
    as the next test expects: a released step of a rate-limited node is held for a new token
    (migration 31), which the sweep gives."""
    for lease in leases:
        assert engine.release_step(env.conn, lease.step_id, lease.token)
    sweep_held_steps(env.conn)


def _drain(env: TestEnv, steps: int) -> None:
    """Lease and complete steps one by one, as workers do: each end frees a slot, and the
    node's admissions leave their dead entries in its indexes (nothing vacuums here)."""
    for _ in range(steps):
        lease = engine.lease_step(env.conn, worker="pa", workflows=[wide.name])
        assert lease is not None
        assert engine.complete_step(env.conn, lease, None)


@pytest.fixture(scope="module", params=STATES)
def held(request: pytest.FixtureRequest, pg_dsn: str) -> Iterator[TestEnv]:
    with TestEnv(workflows=[wide, plain], dsn=pg_dsn) as env:
        for table in ("cyclone_steps", "cyclone_runs"):
            env.conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
        env.client.set_rate_limit("pa-limiter", rate=1e6, per=timedelta(seconds=1), burst=1e6)
        if request.param == "analyzed_empty":
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs")
        if request.param == "analyzed_history":
            # A drained history of the node: its steps ended in one statement each batch.
            for _ in range(2):
                env.client.submit_many(wide, [None] * 5000)
                env.conn.execute(
                    "UPDATE cyclone_steps SET state = 'completed', completed_at = now(),"
                    " attempt = 1 WHERE state IN ('available', 'waiting')"
                )
            env.conn.execute("UPDATE cyclone_runs SET state = 'completed', finished_at = now()")
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs")
        for start in range(0, HELD, 1000):
            env.client.submit_many(wide, [None] * min(1000, HELD - start))
        for _ in range(0, AVAILABLE, 5000):
            env.client.submit_many(plain, [None] * 5000)
        _drain(env, 300)
        if request.param == "analyzed":
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs")
        yield env


def _explain(env: TestEnv, mode: str, **extra: Any) -> Any:
    return probe_text(env.conn, ADMIT, {**PARAMS, **extra}, mode)


@pytest.mark.parametrize("mode", ["custom", "generic"])
def test_a_freed_slot_with_16_steps_available_reads_only_those(held: TestEnv, mode: str):
    lease = engine.lease_step(held.conn, worker="pa", workflows=[wide.name])
    assert lease is not None
    try:
        assert _states(held)["available"] >= 16
        probe_text(held.conn, ADMIT, PARAMS, mode)  # the session plans the function's queries
        result = _explain(held, mode)
        assert result.buffers <= PROBE_BOUND, result.text
    finally:
        _give_back(held, [lease])


@pytest.mark.parametrize("mode", ["custom", "generic"])
def test_an_admission_reads_and_writes_the_steps_it_admits_not_the_backlog(
    held: TestEnv, mode: str
):
    """Most of the node's slots are in use by running steps and fewer than 16 are available:
    the admission fills the free slots, at a cost that follows them, whatever waits behind."""
    leases = []
    # Leased until fewer than 16 are available (the marked step's lease admits what fits:
    # migration 30), so the running ones hold most slots.
    while _states(held)["available"] >= 16 and len(leases) < LIMIT:
        lease = engine.lease_step(held.conn, worker="pa", workflows=[wide.name])
        assert lease is not None
        leases.append(lease)
    try:
        states = _states(held)
        assert states["available"] < 16 and states["held"] > HELD // 2, states
        free = LIMIT - states["available"] - states["running"]
        with held.conn.transaction(force_rollback=True):
            # Eight running steps end without their triggers (which would admit): eight
            # slots more for the admission explained.
            held.conn.execute("SET LOCAL session_replication_role = replica")
            held.conn.execute(
                "UPDATE cyclone_steps SET state = 'completed', completed_at = now(),"
                " lease_token = NULL, lease_expires_at = NULL WHERE id = ANY(%s)",
                ([lease.step_id for lease in leases[:8]],),
            )
            held.conn.execute("SET LOCAL session_replication_role = origin")
            result = _explain(held, mode)
        admitted = free + 8
        assert result.buffers <= ADMIT_BASE + ADMIT_PER_STEP * admitted, result.text
    finally:
        _give_back(held, leases)

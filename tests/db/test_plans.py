"""Every hot statement costs the same with a small queue or a large one, whatever the statistics.

The bad case is built for real: a burst of runs submitted through the public API on tables
that PostgreSQL never analyzed, or analyzed while the queue was empty (with and without a
history of finished runs), and then the same tables analyzed. Each statement is explained as
a prepared statement runs it, with its custom plan and with its generic one, and must touch a
number of buffers that does not grow with the backlog (a sweep: with the rows due). A plan
that reads the backlog touches tens of thousands.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from plan_probe import Probe, execute_named, numbered, probe, probe_named, probe_prepared

import cyclone
from cyclone import engine
from cyclone.db import HOT_PLANS, connect, text_array, with_options
from cyclone.engine.advance import node_rows
from cyclone.engine.dispatch import Finished, dispatch_params
from cyclone.engine.runs import submit_params
from cyclone.engine.steps import FLOOR_KEYS, Lease
from cyclone.sql import QUERIES
from cyclone.states import NodeKind
from cyclone.testing import TestEnv

BACKLOG = 20_000
PAUSED = 50  # paused runs with a due step each
# Buffers a statement may touch, whatever the backlog: an index descent or two, the row, its
# run, the rows it writes and their index entries. A plan that reads the backlog touches
# more than BACKLOG / 100.
BOUND = 150
# What a lease scanning from the start may add in the drained-history state: the history's
# 20,000 dead entries in cyclone_steps_ready_idx, not yet marked dead (completed in one
# statement), walked once. Its entries (priority, pass, id, available_at) are wider than
# the (available_at, id) the lease walked before migration 14: 133 pages where that was 120
# (and the prepared lease, which may walk them before a scan marked them, up to 213 in all).
HISTORY_PREFIX = 80
DISPATCHES = {"steps_dispatch", "steps_dispatch_plain"}
LEASES = {"step_lease", "step_complete_chain", "step_complete_last", *DISPATCHES}
# Rows a scan may read (return, or drop by a filter): a plan that walks the backlog reads
# thousands, though on a small dense index that costs few buffers.
SCAN_ROWS = 500

one = cyclone.Workflow("plans-one")
chain = cyclone.Workflow("plans-chain")
sleepy = cyclone.Workflow("plans-sleepy")
waity = cyclone.Workflow("plans-waity")
fanout = cyclone.Workflow("plans-map")
parent = cyclone.Workflow("plans-parent")


@one.task()
def only(ctx):
    return None


@chain.task()
def c1(ctx):
    return None


@chain.task(after=[c1])
def c2(ctx):
    return None


sleepy.sleep("nap", duration=timedelta(hours=1))
waity.wait("approval", signal="go", max_wait=timedelta(hours=1))


@fanout.map(items=lambda ctx: [1, 2, 3])
def item(ctx):
    return ctx.item


parent.child("kid", workflow=one, input=lambda ctx: None, max_wait=timedelta(hours=1))

bigmap = cyclone.Workflow("plans-bigmap")


@bigmap.map(items=lambda ctx: list(range(2000)))
def big_item(ctx):
    return None


# Flow control: runs per key (one key with a queue of runs, others with one each), and a node
# limited to one step at a time with a backlog held.
keyed = cyclone.Workflow("plans-keyed", concurrency=cyclone.Concurrency(key="k", limit=1))
narrow = cyclone.Workflow("plans-narrow")


@keyed.task()
def keyed_step(ctx):
    return None


@narrow.task(concurrency=1, rate_limit="plans-limiter")
def narrow_step(ctx):
    return None


WORKFLOWS = [one, chain, sleepy, waity, fanout, parent, bigmap, keyed, narrow]


@dataclass
class Backlog:
    env: TestEnv
    state: str
    big_map: str = ""
    queued: str = ""
    leases: dict[str, Lease] = field(default_factory=dict)

    def lease(self, wf: cyclone.Workflow) -> Lease:
        lease = engine.lease_step(self.env.conn, worker="plans", workflows=[wf.name])
        assert lease is not None, wf.name
        return lease


def _burst(env: TestEnv) -> None:
    deadline = timedelta(hours=1)
    for start in range(0, BACKLOG, 5000):
        env.client.submit_many(one, [None] * min(5000, BACKLOG - start), run_deadline=deadline)
    env.client.submit_many(chain, [None] * 1000, run_deadline=deadline)
    env.client.submit_many(sleepy, [None] * 2000, run_deadline=deadline)
    env.client.submit_many(waity, [None] * 2000, run_deadline=deadline)
    env.client.submit_many(fanout, [None] * 100)
    env.client.submit_many(parent, [None] * 100)
    env.client.submit_many(keyed, [{"k": "hot"}] * 1000, run_deadline=deadline)
    env.client.submit_many(keyed, [{"k": f"cold-{i}"} for i in range(500)])
    env.client.set_rate_limit("plans-limiter", rate=1000, per=1.0)
    env.client.submit_many(narrow, [None] * 1000)
    # Paused runs, whose due steps the queue's count leaves out.
    for run_id in env.client.submit_many(one, [None] * PAUSED, run_deadline=deadline):
        env.client.pause(run_id)


def _big_map(env: TestEnv) -> str:
    """A 2,000-item map three quarters done; returns its run's id."""
    env.client.submit(bigmap, None)
    # On the env's clock, which made the step available: the server's now() may run behind it
    # (CI once found nothing to lease here, the step due on one clock and not the other).
    lease = engine.lease_step(env.conn, worker="plans", workflows=[bigmap.name], now=env.now())
    assert lease is not None and engine.expand_map(env.conn, lease, list(range(2000)))
    env.conn.execute(
        "UPDATE cyclone_steps SET state = 'completed', completed_at = now(), attempt = 1"
        " WHERE run_id = %s AND item_index < 1500",
        (lease.run_id,),
    )
    return lease.run_id


def _history(env: TestEnv) -> None:
    """Finished runs, as a queue that drained leaves them."""
    for _ in range(4):
        env.client.submit_many(one, [None] * 5000)
    env.conn.execute(
        "UPDATE cyclone_steps SET state = 'completed', completed_at = now(), attempt = 1"
    )
    env.conn.execute("UPDATE cyclone_runs SET state = 'completed', finished_at = now()")
    # The fair clock those runs left as they ran (the fair_clock sweep, while they were in
    # service): later runs queue after them.
    env.conn.execute("UPDATE cyclone_queues SET pass = (SELECT max(pass) FROM cyclone_steps)")


STATES = ["never_analyzed", "analyzed_empty", "analyzed_history", "analyzed"]


@pytest.fixture(scope="module", params=STATES)
def backlog(request: pytest.FixtureRequest, pg_dsn: str) -> Iterator[Backlog]:
    with TestEnv(workflows=WORKFLOWS, dsn=pg_dsn) as env:
        # Autovacuum must not analyze behind the test's back: each state is built on purpose.
        for table in ("cyclone_steps", "cyclone_runs"):
            env.conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
        if request.param == "analyzed_empty":
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs")
        if request.param == "analyzed_history":
            _history(env)
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs")
        _burst(env)
        big_map = _big_map(env)
        if request.param == "analyzed":
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs")
        queued = env.conn.execute(
            "SELECT id::text FROM cyclone_runs WHERE state = 'queued' LIMIT 1"
        ).fetchone()["id"]
        b = Backlog(env, request.param, big_map=big_map, queued=queued)
        b.leases = {
            "one": b.lease(one),
            "chain": b.lease(chain),
            "map": b.lease(fanout),
            "child": b.lease(parent),
        }
        yield b


def _lease_params(b: Backlog | None, **extra: Any) -> dict[str, Any]:
    return {
        "lease": True, "other_than": None, "worker": "plans", "ttl": 30.0, "now": None,
        "workflows": text_array((one.name, chain.name)), **dict.fromkeys(FLOOR_KEYS),
        "graphs": text_array((one.graph.hash, chain.graph.hash)), **extra,
    }  # fmt: skip


def _completion(lease: Lease, **extra: Any) -> dict[str, Any]:
    return {
        "run_id": lease.run_id, "step_id": lease.step_id, "token": lease.token,
        "output": "null", "now": None, **extra,
    }  # fmt: skip


def _chain_next() -> str:
    from cyclone.engine.steps import _next_nodes_json

    return _next_nodes_json([chain.graph.nodes["c2"]])


def _fenced(b: Backlog, kind: str = "one", **extra: Any) -> dict[str, Any]:
    lease = b.leases[kind]
    return {"step_id": lease.step_id, "token": lease.token, "run_id": lease.run_id, "now": None,
            **extra}  # fmt: skip


# Each statement with the parameters its caller gives it. The lambdas read the backlog's
# leases, taken once per state.
STATEMENTS: dict[str, Callable[[Backlog], dict[str, Any]]] = {
    # A worker's per-step statements.
    "step_lease": lambda b: _lease_params(b),
    "step_complete_chain": lambda b: {
        **_completion(b.leases["chain"], next=_chain_next()),
        **_lease_params(b, other_than=b.leases["chain"].run_id),
    },
    "step_complete_last": lambda b: {**_completion(b.leases["one"]), **_lease_params(b)},
    "step_complete": lambda b: _completion(b.leases["one"]),
    # The supervisor's statement for its workers: two finished (a chain's and a run's last),
    # three waiting.
    "steps_dispatch": lambda b: {
        **dispatch_params(
            [
                Finished(
                    b.leases["chain"].step_id,
                    b.leases["chain"].token,
                    b.leases["chain"].run_id,
                    None,
                    json.loads(_chain_next()),
                ),
                Finished(
                    b.leases["one"].step_id,
                    b.leases["one"].token,
                    b.leases["one"].run_id,
                    None,
                    last=True,
                ),
            ],
            ["plans:1", "plans:2", "plans:3"],
            workflows=(one.name, chain.name),
            lease_ttl=30.0,
            graphs=(one.graph.hash, chain.graph.hash),
        ),
        **dict.fromkeys(FLOOR_KEYS),
    },
    "step_heartbeat": lambda b: _fenced(b, ttl=30.0),
    "steps_renew": lambda b: {
        "step_ids": [lease.step_id for lease in b.leases.values()],
        "tokens": [lease.token for lease in b.leases.values()],
        "ttl": 30.0,
        "now": None,
    },
    "step_fail": lambda b: (
        _fenced(b, kind="one", error="boom", retry=True, backoff_base=1.0, backoff_cap=600.0)
        | {"kind": "error"}
    ),
    "step_release": lambda b: _fenced(b),
    "steps_release": lambda b: {
        "step_ids": [lease.step_id for lease in b.leases.values()],
        "tokens": [lease.token for lease in b.leases.values()],
        "now": None,
    },
    "step_release_items": lambda b: _fenced(b, "map", item="1"),
    "step_park_child": lambda b: _fenced(
        b, "child", child_run_id="00000000-0000-0000-0000-000000000001", max_wait=3600.0
    ),
    "step_revoked": lambda b: {
        "step_ids": [lease.step_id for lease in b.leases.values()],
        "tokens": [lease.token for lease in b.leases.values()],
    },
    # The general completion's reads and writes of its run.
    "run_lock": lambda b: {"run_id": b.leases["one"].run_id},
    "run_results": lambda b: {"run_id": b.leases["chain"].run_id},
    "map_item_pending": lambda b: {"run_id": b.big_map, "node": "big_item"},
    "step_nodes_done": lambda b: {"run_id": b.leases["chain"].run_id, "nodes": ["c1", "c2"]},
    "run_complete_if_done": lambda b: {
        "run_id": b.leases["chain"].run_id,
        "sinks": ["c2"],
        "node_count": 2,
        "now": None,
    },
    "step_insert": lambda b: {
        "run_id": b.leases["chain"].run_id,
        "workflow": chain.name,
        "now": None,
        **node_rows([chain.graph.nodes["c2"]]),
    },
    # Flow control: a submit under a key with a queue of runs (its lock, its count of active
    # runs, its group's last pass), and the admission of a queued run.
    "concurrency_lock": lambda b: {"workflow": keyed.name, "ckeys": ["hot"]},
    "run_submit": lambda b: submit_params(
        keyed.name,
        keyed.graph.hash,
        ["00000000-0000-0000-0000-0000000000aa"],
        ['{"k":"hot"}'],
        [keyed.graph.nodes["keyed_step"]],
        ckeys=["hot"],
        climit=1,
    ),
    "run_admit": lambda b: {"run_id": b.queued, "now": None},
    # A DLQ retry of a keyed run counts its key's active runs (under the lock above).
    "dlq_key_active": lambda b: {"workflow": keyed.name, "key": "hot"},
    # Each pass admits the held steps of the limited node: one node, its slot taken.
    "sweep_held_steps": lambda b: {"batch_size": 500, "now": None},
    "sweep_fair_clock": lambda b: {},
    "sweep_queued_deadlines": lambda b: {"batch_size": 500, "now": None},
    # The scanner's sweeps: nothing is due, so nothing may be read.
    "sweep_deadlines": lambda b: {"batch_size": 500, "now": None},
    "sweep_expired_leases": lambda b: {"batch_size": 500, "now": None, "outage_grace": 30.0},
    "sweep_max_wait": lambda b: {"batch_size": 500, "now": None},
    "sweep_sleeps": lambda b: {"batch_size": 500, "now": None},
    "sweep_retention": lambda b: {"batch_size": 500, "now": None, "retention": 86400.0},
    # History (migration 18): the backlog's ended runs are younger than history_after.
    "sweep_history": lambda b: {"tail": 30.0, "retention": 86400.0, "batch_size": 500, "now": None},
    "history_droppable": lambda b: {"retention": 86400.0, "now": None},
    "sweep_stale_supervisors": lambda b: {"batch_size": 100, "now": None, "stale_after": 60.0},
    "sweep_schedules": lambda b: {"batch_size": 500, "now": None},
    # Nothing is parked and no supervisor is live: it reads nothing.
    "sweep_unserved": lambda b: {"batch_size": 500, "now": None, "lost_after": 10.0},
    # ctx.patched()'s first call in a run: the change's row and the run's, by their keys.
    "run_patched": lambda b: {
        "run_id": b.leases["one"].run_id,
        "workflow": one.name,
        "patch": "plans-change",
        "registered_at": None,
    },
    # What an operator reads during an incident.
    "run_list": lambda b: {"state": None, "workflow": None, "limit": 50},
    "run_get": lambda b: {"run_id": b.leases["one"].run_id},
    "run_steps": lambda b: {"run_id": b.leases["chain"].run_id},
    "run_steps_summary": lambda b: {"run_id": b.leases["chain"].run_id},
    "run_steps_page": lambda b: {"run_id": b.leases["chain"].run_id, "state": None, "limit": 50},
    "dlq_list": lambda b: {"reason": None, "workflow": None, "since": None, "limit": 50},
    "status_queue": lambda b: {"cap": 10_000},
    "status_dlq_depth": lambda b: {},
    "status_deadline_failures": lambda b: {"limit": 20},
    "status_paused_runs": lambda b: {"limit": 20},
    "status_workers": lambda b: {"limit": 50},
    "status_schedules": lambda b: {"limit": 10},
    # Counts of live runs: their cost follows the live runs counted, never the history.
    "status_runs_by_state": lambda b: {"window": 3600.0},
    "metrics_gauges": lambda b: {
        "cap": 10_000,
        "lost_after": 30.0,
        "served": [],
        "graphs": None,
        "self_id": None,
    },
    "status_unserved": lambda b: {
        "served": [],
        "graphs": None,
        "lost_after": 30.0,
        "self_id": None,
        "limit": 20,
    },
    # Waking (migration 22): the flag, and the scanner's look ahead at the next time due.
    "wake_arm": lambda b: {"most": 0.0},
    "wake_ready": lambda b: {},
    "wake_timer": lambda b: {"horizon": 60.0, "since": None, "most": 0.0},
}
# What each count may touch: an index-only scan of the live runs, plus a heap page for each
# page of runs autovacuum has not yet marked all-visible.
LIVE_RUNS = BACKLOG + 5_200 + PAUSED + 2_500  # 2,500: the flow-control runs
COUNTS = {"status_runs_by_state", "metrics_gauges", "status_unserved"}


# Called again and again on one session, through PL/pgSQL functions whose plans the session
# keeps: measured at a second call, as they run (the first plans each query inside, which reads
# the catalog and pg_statistic, the more the more statistics there are).
# steps_dispatch_plain: steps_dispatch for a supervisor whose graphs limit no node, with the
# same parameters.
STATEMENTS["steps_dispatch_plain"] = STATEMENTS["steps_dispatch"]
WARMED = {"wake_timer"}


# Run unprepared by their callers (a custom plan every time): their optional filters leave a
# generic plan blind to which apply.
UNPREPARED = {"run_list"}


PLANS = [
    (name, mode)
    for name in STATEMENTS
    for mode in ("custom", "generic")
    if mode == "custom" or name not in UNPREPARED
]


@pytest.mark.parametrize(("name", "mode"), PLANS)
def test_statement_cost_does_not_follow_the_backlog(backlog: Backlog, name: str, mode: str):
    params = STATEMENTS[name](backlog)
    if name in WARMED:
        probe(backlog.env.conn, name, params, mode)
    result = probe(backlog.env.conn, name, params, mode)
    _check_bounds(backlog, name, mode, params, result)


def _check_bounds(
    backlog: Backlog, name: str, mode: str, params: dict[str, Any], result: Probe
) -> None:
    bound = BOUND
    if name == "status_queue":
        # It counts due steps up to its cap, in the index's order (the heap pages of those
        # rows, a page for every ten or so), and the due steps of each paused run through its
        # run_id: that is what it returns.
        bound = BOUND + params["cap"] // 10 + 5 * PAUSED
    if name in DISPATCHES:
        bound = 2 * BOUND  # it does five steps' work: two completions and three leases
    if name in COUNTS:
        bound = BOUND + LIVE_RUNS // 25
    if name == "metrics_gauges":
        bound += params["cap"] // 10 + 5 * PAUSED  # it counts the queue too, as status_queue
    if name in LEASES and backlog.state == "analyzed_history":
        bound += HISTORY_PREFIX
    if name in COUNTS and backlog.state == "analyzed_history":
        # The 20,000 entries the history's runs left in cyclone_runs_live_idx when one UPDATE
        # ended them, each a heap visit until a scan marks it dead: the first count walks them.
        bound += 300
    assert result.buffers <= bound, _explain_failure(backlog, name, mode, result)
    assert result.sorted_rows() <= 500, _explain_failure(backlog, name, mode, result)
    # The counts of live runs read each once. The queue counts' walk to their cap is inside
    # cyclone_due_count, which the plan does not show: the buffers above bound it.
    rows = SCAN_ROWS + (LIVE_RUNS if name in COUNTS else 0)
    assert result.scanned_rows() <= rows, _explain_failure(backlog, name, mode, result)


@pytest.mark.parametrize("mode", ["custom", "generic"])
@pytest.mark.parametrize("state", [None, "dead"])
def test_a_page_of_a_big_runs_steps_reads_that_run_only(
    backlog: Backlog, mode: str, state: str | None
):
    """`cyclone steps RUN` on a 2,000-item map made after the backlog (`--state dead`: of which
    it has none): its run's steps are read through an index and sorted, never the table walked
    in id order from the start (what `ORDER BY s.id` instead of `s.id + 0` let the planner do)."""
    params = {"run_id": backlog.big_map, "state": state, "limit": 50}
    result = probe(backlog.env.conn, "run_steps_page", params, mode)
    # Its 2,000 steps, read through an index (a bitmap of its node's may count them twice
    # over): a walk of the table reads the whole backlog, over 25,000.
    assert result.scanned_rows() <= 4 * 2000 + SCAN_ROWS, _explain_failure(
        backlog, "run_steps_page", mode, result
    )


@pytest.mark.parametrize("mode", ["custom", "generic"])
@pytest.mark.parametrize("serves", ["all", "chain"])
def test_the_unserved_sweep_reads_the_runs_of_unserved_graphs_only(
    backlog: Backlog, mode: str, serves: str
):
    """With a live supervisor, the sweep that parks the steps of runs no one serves reads the
    registered graphs and, for a graph none serves, its workflow's live runs: never every
    running run (it did, each pass: most of the scanner's core at a backlog of 300,000). The
    supervisor serves every workflow, or only plans-chain, so that the 2,000 runs of
    plans-sleepy (a workflow of few runs) are unserved and read, and the 20,000 of plans-one
    are unserved too but past the batch of 500 (the LIMIT stops the walk)."""
    conn = backlog.env.conn
    workflows = None if serves == "all" else [chain.name]
    conn.execute(
        "INSERT INTO cyclone_supervisors (id, host, pid, workflows) VALUES ('plans', 'h', 1, %s)",
        (workflows,),
    )
    try:
        result = probe(conn, "sweep_unserved", STATEMENTS["sweep_unserved"](backlog), mode)
    finally:
        conn.execute("DELETE FROM cyclone_supervisors WHERE id = 'plans'")
    bound = 10 if serves == "all" else 2 * 2_000 + 500
    assert result.scanned_rows("cyclone_runs") <= bound, result.text


_ZERO = "00000000-0000-0000-0000-000000000000"


def _dummy_lease() -> Lease:
    return Lease(
        step_id=0, run_id=_ZERO, workflow=one.name, node="only", kind=NodeKind.TASK, attempt=1,
        max_attempts=1, token=_ZERO, input=None, item_index=None, item=None, deadline_at=None,
        graph_hash=one.graph.hash, kill_after=None, deadline_left=None, lease_ttl=30.0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cold(pg_dsn: str) -> Iterator[tuple[Backlog, Any]]:
    """The plan tests' backlog, each statement prepared and run once (its generic plan made)
    beforehand, by a session with the hot sessions' options, on tables still empty and never
    analyzed: a supervisor started on a fresh install before the first burst. Its plans are
    kept through the burst (nothing invalidates them until autovacuum analyzes)."""
    with TestEnv(workflows=WORKFLOWS, dsn=pg_dsn) as env:
        for table in ("cyclone_steps", "cyclone_runs"):
            env.conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
        with connect(with_options(env.dsn, HOT_PLANS)) as session:
            dummy = Backlog(env, "planned_empty", big_map=_ZERO, queued=_ZERO)
            dummy.leases = {k: _dummy_lease() for k in ("one", "chain", "map", "child")}
            for name in COLD:
                text, names = numbered(QUERIES[name])
                session.execute(f"PREPARE cold_{name} AS {text}")  # type: ignore[arg-type]
                params = STATEMENTS[name](dummy)
                try:
                    with session.transaction(force_rollback=True):
                        session.execute(execute_named(f"cold_{name}", [params[n] for n in names]))
                except psycopg.Error:
                    pass  # a dummy the statement refuses: its plan was made before it ran
            _burst(env)
            b = Backlog(env, "planned_empty", big_map=_big_map(env))
            b.queued = env.conn.execute(
                "SELECT id::text FROM cyclone_runs WHERE state = 'queued' LIMIT 1"
            ).fetchone()["id"]
            b.leases = {"one": b.lease(one), "chain": b.lease(chain), "map": b.lease(fanout),
                        "child": b.lease(parent)}  # fmt: skip
            yield b, session


# The statements of the sessions that plan once (db.HOT_PLANS: the dispatcher's, the
# workers', the scanner's). Not the listings, run unprepared by a client, nor the counts of
# live runs that status and the metrics gauges read on sessions of their own, whose cost
# follows the live runs by design (COUNTS).
COLD = [name for name in STATEMENTS if name not in UNPREPARED and name not in COUNTS]


@pytest.mark.parametrize("name", COLD)
def test_a_plan_made_on_empty_tables_does_not_follow_the_burst_behind_it(
    cold: tuple[Backlog, Any], name: str
):
    """The same bounds, for the plan a hot session made before the burst: one made for empty,
    never-analyzed tables walked the whole backlog (steps_dispatch: a seq scan of the steps and
    of the runs, 2,318 buffers a statement at 50,000 runs) until autovacuum analyzed them."""
    backlog, session = cold
    params = STATEMENTS[name](backlog)
    args = [params[n] for n in numbered(QUERIES[name])[1]]
    if name in WARMED:
        probe_named(session, f"cold_{name}", args)
    _check_bounds(backlog, name, "generic", params, probe_named(session, f"cold_{name}", args))


@pytest.mark.parametrize("mode", ["custom", "generic"])
def test_a_submit_without_a_key_reads_one_entry_for_its_groups_last_pass(
    backlog: Backlog, mode: str
):
    """A submit_many of 100 runs of a workflow with 20,000 live runs and no concurrency key:
    its group is the whole workflow. The group's last pass is one entry of the fair index read
    backward, once per group: counting the group's live runs (max() planned as a bitmap scan)
    made each submit cost the backlog, and a churn stalled on it; the group's subqueries run
    for every run of the statement when the planner pulls the CTE up."""
    ids = [f"00000000-0000-0000-0000-{i:012x}" for i in range(1, 101)]
    params = submit_params(one.name, one.graph.hash, ids, ["null"] * 100, [one.graph.nodes["only"]])
    result = probe(backlog.env.conn, "run_submit", params, mode)
    assert any(s.startswith(("Index", "Bitmap Heap")) and s.endswith(":cyclone_runs")
               for s in result.scans())  # fmt: skip
    assert result.scanned_rows("cyclone_runs") <= 10, _explain_failure(
        backlog, "run_submit", mode, result
    )


def _explain_failure(b: Backlog, name: str, mode: str, result: Probe) -> str:
    return (
        f"{name} ({mode} plan, {b.state}) touched {result.buffers} buffers with a backlog of "
        f"{BACKLOG:,} steps:\n{result.text}"
    )


def test_the_lease_psycopg_prepared_keeps_its_plan(backlog: Backlog):
    """The real path: lease_step run past psycopg's prepare threshold and PostgreSQL's
    five custom plans, then its prepared statement explained as the session would run it."""
    with connect(backlog.env.dsn) as conn:
        for _ in range(12):
            lease = engine.lease_step(conn, worker="plans", workflows=[one.name])
            assert lease is not None
        params = _lease_params(backlog, workflows=text_array((one.name,)))
        text, names = numbered(QUERIES["step_lease"])
        result = probe_prepared(conn, text, [params[n] for n in names])
    bound = BOUND + (HISTORY_PREFIX if backlog.state == "analyzed_history" else 0)
    assert result.buffers <= bound, result.text


def _dead_prefix(env: TestEnv, dead: int) -> None:
    """`dead` steps that left the candidate index's left edge, their entries not yet vacuumed
    (completed in one statement, so no scan has marked the entries dead either)."""
    env.conn.execute(
        "UPDATE cyclone_steps SET state = 'completed', completed_at = now(), attempt = 1"
        " WHERE id IN (SELECT id FROM cyclone_steps WHERE state = 'available'"
        " ORDER BY priority, pass, id LIMIT %s)",
        (dead,),
    )


def test_a_lease_starts_after_the_connections_last_lease_and_skips_the_dead_prefix(
    env: TestEnv,
):
    env.register(one)
    env.conn.execute("ALTER TABLE cyclone_steps SET (autovacuum_enabled = off)")
    for _ in range(4):
        env.client.submit_many(one, [None] * 5000)
    _dead_prefix(env, 15_000)
    # Where a connection that leased those steps would start from.
    last = env.conn.execute(
        "SELECT priority, pass, id FROM cyclone_steps WHERE state = 'completed'"
        " ORDER BY priority DESC, pass DESC, id DESC LIMIT 1"
    ).fetchone()
    params = _lease_params(None, workflows=text_array((one.name,)))
    after = {**params, **dict(zip(FLOOR_KEYS, last.values(), strict=True))}
    # The session's first calls plan the function's query, reading the catalogs: not counted.
    for _ in range(2):
        from_last = probe(env.conn, "step_lease", after, "generic")
    from_start = probe(env.conn, "step_lease", params, "generic")
    assert from_start.buffers > 300, from_start.text  # the case the floor is for
    assert from_last.buffers <= BOUND, from_last.text


def test_a_step_made_available_behind_the_last_lease_is_still_leased(
    env: TestEnv, monkeypatch: pytest.MonkeyPatch
):
    env.register(one)
    runs = env.client.submit_many(one, [None] * 3)
    leases = [engine.lease_step(env.conn, worker="plans", workflows=[one.name]) for _ in runs]
    assert all(leases)
    # The first comes back behind the connection's last lease, as a step committed by a
    # transaction older than that lease would.
    straggler = leases[0]
    assert engine.release_step(env.conn, straggler.step_id, straggler.token)
    env.conn.execute(
        "UPDATE cyclone_steps SET pass = -1 WHERE id = %s",
        (straggler.step_id,),
    )
    # Nothing after the last lease: the lease looks again from the start.
    again = engine.lease_step(env.conn, worker="plans", workflows=[one.name])
    assert again is not None and again.step_id == straggler.step_id

    # With steps after the last lease, a straggler waits at most FULL_SCAN_EVERY.
    env.client.submit_many(one, [None] * 2)
    assert engine.release_step(env.conn, again.step_id, again.token)
    env.conn.execute(
        "UPDATE cyclone_steps SET pass = -2 WHERE id = %s",
        (again.step_id,),
    )
    monkeypatch.setattr(engine.steps, "FULL_SCAN_EVERY", 3600.0)
    ahead = engine.lease_step(env.conn, worker="plans", workflows=[one.name])
    assert ahead is not None and ahead.step_id != straggler.step_id
    monkeypatch.setattr(engine.steps, "FULL_SCAN_EVERY", 0.0)
    late = engine.lease_step(env.conn, worker="plans", workflows=[one.name])
    assert late is not None and late.step_id == straggler.step_id

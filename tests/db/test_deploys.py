"""Deploys under running runs (issue 26, SPEC section 15): a lease takes only steps of graph
versions the caller's code can run; runs of a version no live VM serves are parked out of the
lease index and reported; ctx.patched() answers once per run; `cyclone workflows` lists it all."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from cli_support import run_cli
from plan_probe import probe

import cyclone
from cyclone import engine, runner
from cyclone.db import text_array
from cyclone.engine.dispatch import dispatch
from cyclone.engine.versions import runs_on, served_graphs
from cyclone.status import take_snapshot
from cyclone.testing import TestEnv
from cyclone.workflow import Registry

# One workflow, three versions of its code: v2 renames `fetch` and adds a node; v1b keeps
# v1's nodes and changes a timeout (a new graph hash that v1's runs can run on).
v1 = cyclone.Workflow("deploy-orders")
v2 = cyclone.Workflow("deploy-orders")
v1b = cyclone.Workflow("deploy-orders")


@v1.task(name="fetch")
def v1_fetch(ctx):
    return "v1"


@v1.task(name="ship", after=["fetch"])
def v1_ship(ctx):
    return "v1"


@v2.task(name="load")
def v2_load(ctx):
    return "v2"


@v2.task(name="ship", after=["load"])
def v2_ship(ctx):
    return "v2"


@v2.task(name="notify", after=["ship"])
def v2_notify(ctx):
    return "v2"


@v1b.task(name="fetch", timeout=timedelta(seconds=30))
def v1b_fetch(ctx):
    return "v1b"


@v1b.task(name="ship", after=["fetch"])
def v1b_ship(ctx):
    return "v1b"


# v1 with a node limit: its runs hold node slots (migration 33), and run on v1's code.
v1c = cyclone.Workflow("deploy-orders")


@v1c.task(name="fetch", concurrency=2)
def v1c_fetch(ctx):
    return "v1c"


@v1c.task(name="ship", after=["fetch"])
def v1c_ship(ctx):
    return "v1c"


def register(env: TestEnv, wf: cyclone.Workflow) -> None:
    engine.register_workflows(env.conn, [wf], now=env.now())


def lease(env: TestEnv, wf: cyclone.Workflow) -> engine.Lease | None:
    return engine.lease_step(
        env.conn, worker="deploy", workflows=[wf.name],
        graphs=served_graphs(env.conn, Registry([wf])),
    )  # fmt: skip


def publish(env: TestEnv, sup_id: str, graphs: list[str] | None, workflows: Any = None) -> None:
    env.conn.execute(
        "INSERT INTO cyclone_supervisors (id, host, pid, workers_target, workflows, graphs)"
        " VALUES (%s, 'vm', 1, 1, %s, %s) ON CONFLICT (id) DO UPDATE SET seen_at = now()",
        [sup_id, workflows if workflows is not None else ["deploy-orders"], graphs],
    )


def test_a_version_runs_on_code_that_has_every_node_a_worker_runs() -> None:
    assert runs_on(v1.graph, v1b.graph) and runs_on(v1b.graph, v1.graph)
    assert not runs_on(v1.graph, v2.graph)  # `fetch` was renamed
    assert not runs_on(v2.graph, v1.graph)  # v1 has no `load`, no `notify`
    other = cyclone.Workflow("deploy-other")
    other.task(v1_fetch, name="fetch")
    other.task(v1_ship, name="ship", after=["fetch"])
    assert not runs_on(v1.graph, other.graph)  # same nodes, another workflow
    kinds = cyclone.Workflow("deploy-orders")
    kinds.wait("fetch", signal="go")
    kinds.task(v1_ship, name="ship", after=["fetch"])
    assert not runs_on(v1.graph, kinds.graph)  # a task is not a wait
    kid_a, kid_b = cyclone.Workflow("deploy-kid-a"), cyclone.Workflow("deploy-kid-b")
    kid_a.wait("w", signal="s")
    kid_b.wait("w", signal="s")
    parent_a, parent_b = cyclone.Workflow("deploy-parent"), cyclone.Workflow("deploy-parent")
    parent_a.child("kid", workflow=kid_a, input=lambda ctx: None)
    parent_b.child("kid", workflow=kid_b, input=lambda ctx: None)
    assert not runs_on(parent_a.graph, parent_b.graph)  # another child workflow


def test_each_version_leases_only_the_steps_its_code_has(env: TestEnv) -> None:
    register(env, v1)
    old = env.client.submit("deploy-orders", {})
    register(env, v2)
    new = env.client.submit("deploy-orders", {})
    assert served_graphs(env.conn, Registry([v1])) == (v1.graph.hash,)
    # Old code first: it must not take the new run's `load`, though that is due and first
    # in line for nobody else.
    got = lease(env, v1)
    assert got is not None and (got.run_id, got.node) == (old, "fetch")
    assert lease(env, v1) is None
    got = lease(env, v2)
    assert got is not None and (got.run_id, got.node) == (new, "load")
    assert lease(env, v2) is None
    # With no filter (an older caller), both were one queue.
    register(env, v1b)
    again = env.client.submit("deploy-orders", {})
    # v1b's code runs v1's runs too (same nodes), and its own; never v2's.
    assert set(served_graphs(env.conn, Registry([v1b]))) == {v1.graph.hash, v1b.graph.hash}
    got = lease(env, v1b)
    assert got is not None and got.run_id == again


def test_the_supervisors_statement_takes_the_same_rule(env: TestEnv) -> None:
    register(env, v2)
    new = env.client.submit("deploy-orders", {})
    register(env, v1)
    old = env.client.submit("deploy-orders", {})
    workers = ["vm:1", "vm:2"]
    got = dispatch(env.conn, [], workers, workflows=["deploy-orders"],
                   graphs=served_graphs(env.conn, Registry([v1])))  # fmt: skip
    assert [r["run_id"] for r in got.leases.values()] == [old]
    got = dispatch(env.conn, [], workers, workflows=["deploy-orders"],
                   graphs=served_graphs(env.conn, Registry([v2])))  # fmt: skip
    assert [r["run_id"] for r in got.leases.values()] == [new]


def test_runs_no_live_vm_serves_are_parked_reported_and_taken_back(
    env: TestEnv, capsys: pytest.CaptureFixture[str]
) -> None:
    register(env, v1)
    old = [env.client.submit("deploy-orders", {}) for _ in range(3)]
    register(env, v2)
    new = env.client.submit("deploy-orders", {})
    # Only v2 is deployed: v1's runs wait, parked; v2's step stays where it is.
    publish(env, "vm-v2", [v2.graph.hash])
    assert engine.sweep_unserved(env.conn) == 3
    rows = env.conn.execute(
        "SELECT run_id::text, state FROM cyclone_steps WHERE node IN ('fetch', 'load')"
    ).fetchall()
    states = {r["run_id"]: r["state"] for r in rows}
    assert {states[r] for r in old} == {"waiting"} and states[new] == "available"
    snap = take_snapshot(env.conn)
    assert snap.unserved == [
        {"workflow": "deploy-orders", "graph_hash": v1.graph.hash, "runs": 3}
    ]
    r = run_cli(capsys, env, "workflows", "--json")
    versions = {v["graph_hash"]: v for v in json.loads(r.out)["versions"]}
    assert versions[v1.graph.hash]["live_runs"] == 3
    assert versions[v1.graph.hash]["served_by"] == []
    assert versions[v2.graph.hash]["served_by"] == ["vm-v2"]
    assert versions[v2.graph.hash]["current"] and not versions[v1.graph.hash]["current"]
    r = run_cli(capsys, env, "workflows")
    assert v1.graph.hash[:12] in r.out and "NONE" in r.out
    # Parked steps are out of every lease, even one with no filter at all.
    assert engine.lease_step(env.conn, worker="any").run_id == new
    # Nothing fails them: a scan later they wait still.
    env.advance_time(timedelta(hours=1))
    env.run_until_idle()
    assert {env.client.get_run(r).state for r in old} == {"running"}
    # A VM of v1 comes back: its steps are available again, then leased and run to the end.
    # (The hour forgot both VMs' rows, as the stale-supervisors sweep does: v2's is back.)
    publish(env, "vm-v2", [v2.graph.hash])
    publish(env, "vm-v1", [v1.graph.hash])
    assert engine.sweep_unserved(env.conn) == 3
    assert take_snapshot(env.conn).unserved == []
    got = lease(env, v1)
    assert got is not None and got.run_id in old


def test_parked_steps_wait_for_their_own_deadline_only(env: TestEnv) -> None:
    register(env, v1)
    run = env.client.submit("deploy-orders", {}, run_deadline=timedelta(minutes=5))
    register(env, v2)
    publish(env, "vm-v2", [v2.graph.hash])
    engine.sweep_unserved(env.conn)
    env.advance_time(timedelta(minutes=4))
    env.run_until_idle()
    assert env.client.get_run(run).state == "running"
    env.advance_time(timedelta(minutes=2))
    env.run_until_idle()
    assert env.client.get_run(run).state == "failed"


def test_an_older_supervisor_serves_every_version_of_its_workflows(env: TestEnv) -> None:
    register(env, v1)
    env.client.submit("deploy-orders", {})
    register(env, v2)
    publish(env, "vm-old", None)  # no `graphs`: before migration 16
    assert engine.sweep_unserved(env.conn) == 0
    assert take_snapshot(env.conn).unserved == []


def test_a_lease_does_not_walk_a_retired_versions_backlog(env: TestEnv) -> None:
    """Thousands of steps of a version nobody serves sit at the head of the lease index: a
    lease from the start walks them all (each a heap visit and a run lookup), until the
    `unserved` sweep parks them; then it reads what a lease always reads."""
    register(env, v1)
    env.conn.execute("ALTER TABLE cyclone_steps SET (autovacuum_enabled = off)")
    env.client.submit_many("deploy-orders", [{}] * 3000)
    register(env, v2)
    env.client.submit("deploy-orders", {})
    publish(env, "vm-v2", [v2.graph.hash])
    params = {
        "lease": True, "other_than": None, "worker": "plans", "ttl": 30.0, "now": None,
        "workflows": text_array(("deploy-orders",)), "after_priority": None,
        "after_pass": None, "after_id": None, "graphs": text_array((v2.graph.hash,)),
    }  # fmt: skip
    for _ in range(2):  # the session's first calls plan the function's query: not counted
        walking = probe(env.conn, "step_lease", params, "generic")
    assert walking.buffers > 3000, walking.text  # the case the sweep is for
    while engine.sweep_unserved(env.conn, batch_size=1000):
        pass
    env.conn.execute("VACUUM cyclone_steps")  # as autovacuum does, in time
    for mode in ("custom", "generic"):
        parked = probe(env.conn, "step_lease", params, mode)
        assert parked.buffers <= 150, parked.text
    # A pass of the sweep once they are parked: each live run read once, and the one step of
    # each unserved run looked up by its run; nothing sorted, no walk of the steps.
    sweep = {"batch_size": 500, "now": None, "lost_after": 10.0}
    for mode in ("custom", "generic"):
        again = probe(env.conn, "sweep_unserved", sweep, mode)
        assert again.scanned_rows() <= 3001 + 3000 + 50, again.text
        assert again.sorted_rows() == 0, again.text


patched_v1 = cyclone.Workflow("deploy-patched")
patched_v2 = cyclone.Workflow("deploy-patched")
seen: list[tuple[str, int, bool]] = []


@patched_v1.task(name="price", max_attempts=2)
def price_v1(ctx):
    return "euros"


@patched_v2.task(name="price", max_attempts=2)
def price_v2(ctx):
    new = ctx.patched("price-in-cents")
    seen.append((ctx.run_id, ctx.attempt, new))
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails: the retry must get the same answer")
    return "cents" if new else "euros"


def run_all(env: TestEnv, wf: cyclone.Workflow) -> None:
    registry = Registry([wf])
    while True:
        graphs = served_graphs(env.conn, registry)
        got = engine.lease_step(
            env.conn, worker="deploy", workflows=[wf.name], graphs=graphs, now=env.now()
        )
        if got is None:
            if engine.sweep_expired_leases(env.conn, now=env.now()):
                continue
            return
        outcome = runner.execute(env.conn, registry, got)
        runner.record(env.conn, got, outcome, now=env.now())
        env.advance_time(timedelta(seconds=5))  # past the retry's backoff


def test_patched_is_true_for_runs_started_after_the_change_registered(env: TestEnv) -> None:
    seen.clear()
    register(env, patched_v1)
    before = env.client.submit("deploy-patched", {})
    env.advance_time(timedelta(seconds=1))
    register(env, patched_v2)  # the same graph: only the handler's code changed
    assert patched_v1.graph.hash == patched_v2.graph.hash
    after = env.client.submit("deploy-patched", {})
    run_all(env, patched_v2)
    assert env.client.result(before, timeout=0) == {"price": "euros"}
    assert env.client.result(after, timeout=0) == {"price": "cents"}
    answers = {(run, attempt): new for run, attempt, new in seen}
    assert answers == {(before, 1): False, (before, 2): False, (after, 1): True, (after, 2): True}
    # Recorded on the run: a later call anywhere reads it, whatever the change's row says.
    env.conn.execute("UPDATE cyclone_patches SET registered_at = '-infinity'")
    assert engine.patched(env.conn, before, "deploy-patched", "price-in-cents") is False
    # A registration later (a restart, another VM) keeps the first time the change was seen.
    env.advance_time(timedelta(hours=1))
    register(env, patched_v2)
    row = env.conn.execute("SELECT registered_at::text AS at FROM cyclone_patches").fetchone()
    assert row["at"] == "-infinity"


def test_a_change_id_only_known_at_run_time_dates_from_its_process_registration(
    env: TestEnv,
) -> None:
    dyn = cyclone.Workflow("deploy-dynamic")
    name = "computed-" + "id"

    @dyn.task()
    def step(ctx):
        return ctx.patched(name)

    before = env.client.submit(dyn, {})  # registers (TestEnv) with the clock as it is
    env.advance_time(timedelta(seconds=1))
    register(env, dyn)
    after = env.client.submit(dyn, {})
    run_all(env, dyn)
    assert env.client.result(before, timeout=0) == {"step": False}
    assert env.client.result(after, timeout=0) == {"step": True}


@pytest.mark.parametrize("bad", [None, 3, "", "x" * 201, "new\nline"])
def test_a_bad_change_id_is_refused_by_name(bad: Any) -> None:
    from cyclone.engine.patches import check_patch_id

    with pytest.raises((TypeError, ValueError), match=r"ctx\.patched"):
        check_patch_id(bad)


def test_literal_change_ids_are_found_in_handlers_and_functions_inside_them() -> None:
    from cyclone.engine.patches import literal_patches

    def handler(ctx):
        def inner():
            return ctx.patched("inner-change")

        return ctx.patched("outer-change") and inner() and ctx.other("not-a-change")

    assert literal_patches(handler) == {"inner-change", "outer-change"}


def test_a_version_no_vm_serves_is_logged_once_until_it_is_served_again(
    env: TestEnv, caplog: pytest.LogCaptureFixture
) -> None:
    from cyclone.child.session import connect_briefly
    from cyclone.supervisor.served import warn_unserved

    register(env, v1)
    env.client.submit("deploy-orders", {})
    register(env, v2)
    publish(env, "vm-v2", [v2.graph.hash])
    told: set[tuple[str, str]] = set()

    def check() -> list[dict[str, Any]]:
        return warn_unserved(lambda: connect_briefly(env.dsn), [], None, [], told)

    with caplog.at_level("WARNING", logger="cyclone.supervisor"):
        assert [r["graph_hash"] for r in check()] == [v1.graph.hash]
        assert check() == []  # the same version: said once
        assert caplog.text.count(f"deploy-orders version {v1.graph.hash[:12]}") == 1
        publish(env, "vm-v1", [v1.graph.hash])
        assert check() == [] and told == set()
        env.conn.execute("DELETE FROM cyclone_supervisors WHERE id = 'vm-v1'")
        assert len(check()) == 1  # retired again: said again
        assert caplog.text.count(f"deploy-orders version {v1.graph.hash[:12]}") == 2


def test_a_failed_look_up_of_versions_keeps_what_the_code_can_surely_run(env: TestEnv) -> None:
    from cyclone.engine.versions import Served

    register(env, v1)
    register(env, v1b)
    clock = [0.0]
    served = Served(Registry([v1b]), every=5.0, clock=lambda: clock[0])
    assert served.graphs == (v1b.graph.hash,)  # before any look-up: its own graph only
    assert set(served.get(env.conn)) == {v1.graph.hash, v1b.graph.hash}
    register(env, v2)
    clock[0] = 1.0
    assert set(served.get(env.conn)) == {v1.graph.hash, v1b.graph.hash}  # not due yet
    broken = psycopg.connect(env.dsn)
    broken.close()
    clock[0] = 6.0
    with pytest.raises(psycopg.Error):
        served.get(broken)
    assert set(served.graphs) == {v1.graph.hash, v1b.graph.hash}


def test_served_versions_say_whether_any_limits_a_node(env: TestEnv) -> None:
    """A supervisor leases with steps_dispatch_plain, which leaves out the steps of nodes
    limited by concurrency, only while no graph it serves has one: a stored version with a
    limit that its code can run turns it back to steps_dispatch at the next look-up."""
    from cyclone.engine.versions import Served

    register(env, v1b)
    served = Served(Registry([v1b]), every=0.0)
    assert not served.limited
    served.get(env.conn)
    assert not served.limited
    register(env, v1c)
    assert v1c.graph.hash in served.get(env.conn) and served.limited
    assert Served(Registry([v1c])).limited  # its own graph, before any look-up

"""A rolling deploy with real processes (issue 26, SPEC section 15): supervisors of two versions
of one module on one database, runs of both in flight, the old one stopped by SIGTERM mid-run.

v2 renames a node of `orders` and adds one (a new graph version), and changes `pricing`'s
logic behind ctx.patched() (the same graph). Every run must complete on code that has its
nodes: v2 never takes a step of a v1 run (it has no `fetch`), v1 never one of a v2 run; the v1
runs left when v1 stops wait, parked and reported, until a VM of v1 comes back; `pricing`
runs started before v2 registered take the old branch on v2's code, those after it the new.
"""

from __future__ import annotations

import signal
from typing import Any

import proc_deploy_v1
import proc_deploy_v2
import pytest
from proc_helpers import wait_for

from cyclone.engine.versions import served_graphs
from cyclone.status import take_snapshot
from cyclone.testing import TestEnv

pytestmark = pytest.mark.process

V1 = {"workflows__modules": '["proc_deploy_v1"]', "scanner__interval": '"0.2s"'}
V2 = {"workflows__modules": '["proc_deploy_v2"]', "scanner__interval": '"0.2s"'}


def steps(env: TestEnv, run_ids: list[str]) -> list[dict[str, Any]]:
    return [dict(r) for r in env.conn.execute(
        "SELECT run_id::text, node, state, parked, output FROM cyclone_steps"
        " WHERE run_id = ANY (%s::uuid[]) ORDER BY id", [run_ids],
    ).fetchall()]  # fmt: skip


def states(env: TestEnv, run_ids: list[str]) -> set[str]:
    return {str(env.client.get_run(r).state) for r in run_ids}


def graph_of(env: TestEnv, run_id: str) -> str:
    return env.conn.execute(
        "SELECT graph_hash FROM cyclone_runs WHERE id = %s", [run_id]
    ).fetchone()["graph_hash"]


def test_a_rolling_deploy_runs_every_run_on_code_that_has_its_nodes(
    env: TestEnv, supervisor
) -> None:
    old = supervisor(workers=2, **V1)
    old_pricing = [env.client.submit("proc-deploy-pricing", {}) for _ in range(3)]
    new = supervisor(workers=2, **V2)  # registers v2: new runs by name take its graph
    new_pricing = [env.client.submit("proc-deploy-pricing", {}) for _ in range(3)]
    # Clients of both versions submit, each with its own code's graph, both VMs up.
    v1_orders = env.client.submit_many(proc_deploy_v1.orders, [{}] * 8)
    v2_orders = env.client.submit_many(proc_deploy_v2.orders, [{}] * 4)
    v1_hash, v2_hash = graph_of(env, v1_orders[0]), graph_of(env, v2_orders[0])
    assert v1_hash != v2_hash

    # v1 stops while it runs v1 steps: it finishes those, leases nothing more, and exits.
    wait_for(lambda: any(s["state"] == "running" for s in steps(env, v1_orders)), 10,
             f"v1 running a step\n{old.log()}")  # fmt: skip
    old.popen.send_signal(signal.SIGTERM)
    assert old.popen.wait(15) == 0, old.log()
    wait_for(lambda: states(env, v2_orders) == {"completed"}, 20, f"v2's runs\n{new.log()}")

    # What v1 left waits: parked by the scanner, reported with the version it needs, never
    # leased by v2 (whose code has no `fetch`), never failed.
    left = [s for s in steps(env, v1_orders) if s["state"] != "completed"]
    assert left, "v1 finished every run before it stopped: nothing was left in flight"
    wait_for(lambda: all(s["parked"] for s in steps(env, v1_orders) if s["state"] != "completed"),
             10, f"v1's steps parked\n{new.log()}")  # fmt: skip
    assert "running" in states(env, v1_orders) <= {"running", "completed"}
    unserved = take_snapshot(env.conn).unserved
    assert {(u["workflow"], u["graph_hash"]) for u in unserved} == {
        ("proc-deploy-orders", v1_hash)
    }
    assert new.sample("cyclone_runs_unserved", workflow="proc-deploy-orders", graph=v1_hash)

    # `pricing` (one graph, new logic behind ctx.patched) runs on v2 alone now.
    for run_id in old_pricing + new_pricing:
        env.client.signal(run_id, "go")
    wait_for(lambda: states(env, old_pricing + new_pricing) == {"completed"}, 20, new.log())
    assert {env.client.result(r)["bill"] for r in old_pricing} == {"v2:v2:euros"}
    assert {env.client.result(r)["bill"] for r in new_pricing} == {"v2:v2:cents"}

    # A VM of v1 comes back to drain v1's runs: they complete there.
    back = supervisor(workers=2, **V1)
    wait_for(lambda: states(env, v1_orders) == {"completed"}, 20, f"v1's runs\n{back.log()}")
    assert take_snapshot(env.conn).unserved == []

    # Each step ran on code of its run's version, and only there.
    for s in steps(env, v1_orders):
        assert (s["node"], s["output"]) in {("fetch", "v1"), ("ship", "v1")}, s
    for s in steps(env, v2_orders):
        assert (s["node"], s["output"]) in {("load", "v2"), ("ship", "v2"), ("notify", "v2")}, s
    for proc in (new, back):
        proc.popen.send_signal(signal.SIGTERM)
        proc.popen.wait(15)
    assert served_graphs  # the rule under test (engine/versions.py)

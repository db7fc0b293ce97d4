"""How a run moves: a node completes, its downstream nodes get steps, the run ends.

Every function here runs inside the caller's transaction, after the caller locked the run.
It stands on runs.py (a run's own operations: lock, cancel, settle), never the other way: a
run's end that reaches its parent (`child_finished`, `fail_run`) is a move of the graph, here.
Nothing here runs user code: nodes that need it (map items, child inputs) get a step that a
worker, which has the code, leases and evaluates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from cyclone.engine.graphs import graph_by_hash, node_rows
from cyclone.engine.runs import (
    cancel_runs,
    describe_failure,
    lock_run,
    notify_revoked,
    settle_late,
)
from cyclone.sql import QUERIES
from cyclone.states import ErrorKind, NodeKind
from cyclone.workflow import Graph

Conn = psycopg.Connection[Any]


@dataclass(frozen=True, slots=True)
class RunRef:
    id: str
    workflow: str
    graph_hash: str


def make_steps(
    conn: Conn, run: RunRef, graph: Graph, names: Sequence[str], now: datetime | None
) -> None:
    specs = [graph.nodes[n] for n in names]
    params = {"run_id": run.id, "workflow": run.workflow, "now": now, **node_rows(specs)}
    cur = conn.execute(QUERIES["step_insert"], params)
    # Only a new wait needs its row back (to take a signal sent early); not fetching otherwise
    # lets a pipelined caller send the insert together with its COMMIT.
    if any(s.kind == NodeKind.WAIT for s in specs):
        for row in cur.fetchall():
            if row["kind"] == NodeKind.WAIT:
                consume_signal(conn, run, graph, row["id"], row["signal"], now)


def consume_signal(
    conn: Conn, run: RunRef, graph: Graph, step_id: int, name: str, now: datetime | None
) -> None:
    """A wait reached after its signal was sent takes the oldest kept signal at once."""
    sig = conn.execute(
        QUERIES["signal_consume"], {"run_id": run.id, "name": name, "step_id": step_id}
    ).fetchone()
    if sig is not None:
        settle_waiting(conn, run, graph, step_id, sig["payload"], now)


def settle_waiting(
    conn: Conn, run: RunRef, graph: Graph | None, step_id: int, output: Any, now: datetime | None
) -> bool:
    from cyclone.db import encode_json

    row = conn.execute(
        QUERIES["step_settle_waiting"],
        {"step_id": step_id, "output": encode_json(output), "now": now},
    ).fetchone()
    if row is None:
        return False
    node_completed(conn, run, graph or graph_by_hash(conn, run.graph_hash), row["node"], now)
    return True


def node_completed(conn: Conn, run: RunRef, graph: Graph, node: str, now: datetime | None) -> None:
    """Give steps to the downstream nodes whose dependencies are now all complete."""
    down = graph.downstream[node]
    if not down:
        complete_run_if_done(conn, run, graph, now)
        return
    done = {node}
    joins = [d for d in down if graph.nodes[d].after != (node,)]
    if joins:
        others = sorted({dep for d in joins for dep in graph.nodes[d].after} - done)
        rows = conn.execute(QUERIES["step_nodes_done"], {"run_id": run.id, "nodes": others})
        done.update(r["node"] for r in rows.fetchall())
    ready = [d for d in down if all(dep in done for dep in graph.nodes[d].after)]
    if ready:
        make_steps(conn, run, graph, ready, now)


def map_completed(conn: Conn, run_id: str, node: str) -> bool:
    """Whether every item of a map node completed (called once an item completed)."""
    rows = conn.execute(QUERIES["map_item_pending"], {"run_id": run_id, "node": node})
    return rows.fetchone() is None


def complete_run_if_done(conn: Conn, run: RunRef, graph: Graph, now: datetime | None) -> None:
    row = conn.execute(
        QUERIES["run_complete_if_done"],
        {
            "run_id": run.id,
            "sinks": list(graph.sinks),
            "node_count": len(graph.nodes),
            "now": now,
        },
    ).fetchone()
    if row is not None and row["parent_run_id"] is not None:
        child_finished(
            conn, row["parent_run_id"], row["parent_step_id"], run.id, now, output=row["output"]
        )


def child_finished(
    conn: Conn,
    parent_id: str,
    parent_step_id: int,
    child_id: str,
    now: datetime | None,
    *,
    output: Any = None,
    failure: str | None = None,
) -> None:
    """A child run ended: its parent's child node completes with its output, or dies."""
    parent = lock_run(conn, parent_id)
    if parent is None or parent["state"] not in ("running", "paused"):
        return
    ref = RunRef(parent["id"], parent["workflow"], parent["graph_hash"])
    if failure is None:
        settle_waiting(conn, ref, None, parent_step_id, output, now)
        return
    row = conn.execute(
        QUERIES["step_kill_waiting"],
        {
            "step_id": parent_step_id,
            "kind": ErrorKind.CHILD_FAILED,
            "now": now,
            "error": f"child run {child_id} {failure}",
        },
    ).fetchone()
    if row is not None:
        fail_run(conn, parent_id, now)


def fail_run(conn: Conn, run_id: str, now: datetime | None) -> None:
    """A step of this run is dead: the run fails, its other work stops, its parent learns."""
    row = conn.execute(QUERIES["run_fail"], {"run_id": run_id, "now": now}).fetchone()
    if row is None:
        return
    settle_late(conn, [run_id], "discarded", None, "run failed", now)
    if row["child_run_ids"]:
        cancel_runs(conn, row["child_run_ids"], now, notify=False)
    notify_revoked(conn)
    if row["parent_run_id"] is not None:
        failure = describe_failure(conn, run_id)
        child_finished(
            conn,
            row["parent_run_id"],
            row["parent_step_id"],
            run_id,
            now,
            failure=f"failed: {failure}",
        )


__all__ = [
    "RunRef",
    "child_finished",
    "complete_run_if_done",
    "consume_signal",
    "fail_run",
    "make_steps",
    "map_completed",
    "node_completed",
    "node_rows",
    "settle_waiting",
]

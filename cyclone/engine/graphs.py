"""Graphs in the database: registered by workflows, read (and cached) by whoever advances runs."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from cyclone.errors import WorkflowNotFound
from cyclone.sql import QUERIES
from cyclone.states import NodeKind
from cyclone.workflow import Graph, NodeSpec, Workflow

# Graphs are immutable once stored (keyed by a hash of their content), so caching them for the
# life of the process is always correct.
_BY_HASH: dict[str, Graph] = {}


def node_rows(specs: Sequence[NodeSpec]) -> dict[str, list[Any]]:
    """Parameters of step_insert / run_submit for a set of nodes (their rows in the graph)."""
    return {
        "nodes": [s.name for s in specs],
        "kinds": [str(s.kind) for s in specs],
        "max_attempts": [s.max_attempts for s in specs],
        "timeouts": [s.timeout for s in specs],
        "signals": [s.signal for s in specs],
        "dues": [s.duration if s.kind == NodeKind.SLEEP else s.max_wait for s in specs],
        "limits": [s.concurrency for s in specs],
        "rates": [s.rate_limit for s in specs],
    }


def registration(workflows: Iterable[Workflow]) -> list[dict[str, Any]]:
    """Parameters of graph_register then workflow_register, for each workflow and its children.

    Run both statements with each, in one transaction: the clients' submits do so too.
    """
    seen: dict[str, Workflow] = {}
    for wf in workflows:
        for item in (wf, *wf.children()):
            seen[item.name] = item
    out = []
    for wf in seen.values():
        graph = wf.graph
        _BY_HASH[graph.hash] = graph
        out.append({
            "hash": graph.hash, "workflow": wf.name, "graph": json.dumps(graph.to_json()),
            "queue": wf.queue, "priority": wf.priority,
            "concurrency_field": wf.concurrency.field if wf.concurrency else None,
            "concurrency_limit": wf.concurrency.limit if wf.concurrency else None,
        })  # fmt: skip
    return out


def graph_by_hash(conn: psycopg.Connection[Any], graph_hash: str) -> Graph:
    graph = _BY_HASH.get(graph_hash)
    if graph is None:
        row = conn.execute(QUERIES["graph_get"], {"hash": graph_hash}).fetchone()
        if row is None:
            raise WorkflowNotFound(f"no graph {graph_hash!r} is stored")
        graph = Graph.from_json(_row(row)["graph"])
        _BY_HASH[graph_hash] = graph
    return graph


def current_graph(conn: psycopg.Connection[Any], workflow: str) -> Graph:
    """The graph registered under this name, for submitting by name."""
    check_workflow_name(workflow)
    row = conn.execute(QUERIES["workflow_get"], {"workflow": workflow}).fetchone()
    return graph_of(workflow, row)


def check_workflow_name(workflow: object) -> None:
    if not isinstance(workflow, str):
        raise TypeError(f"expected a Workflow or a workflow name, got {workflow!r}")


def graph_of(workflow: str, row: Any) -> Graph:
    """The graph in a row of workflow_get (None: no workflow of that name)."""
    if row is None:
        raise WorkflowNotFound(f"no workflow named {workflow!r} is registered")
    row = _row(row)
    graph = _BY_HASH.get(row["hash"])
    if graph is None:
        graph = _BY_HASH[row["hash"]] = Graph.from_json(row["graph"])
    return graph


def _row(row: Any) -> dict[str, Any]:
    return row if isinstance(row, dict) else {"hash": row[0], "graph": row[1]}

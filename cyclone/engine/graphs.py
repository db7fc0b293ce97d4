"""Graphs in the database: registered by workflows, read (and cached) by whoever advances runs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg

from cyclone.errors import WorkflowNotFound
from cyclone.sql import QUERIES
from cyclone.workflow import Graph, Workflow

# Graphs are immutable once stored (keyed by a hash of their content), so caching them for the
# life of the process is always correct.
_BY_HASH: dict[str, Graph] = {}


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


def register_workflows(
    conn: psycopg.Connection[Any], workflows: Iterable[Workflow], *, now: datetime | None = None
) -> None:
    """Store each workflow's graph (and its child workflows') and make it current by name;
    upsert the schedules they declare (and log those no longer declared), all at once. `now`
    places a new schedule's first tick (None: the database clock)."""
    # Here, not at the top: schedules.py reads graphs through this module.
    from cyclone.engine.patches import register_patches
    from cyclone.engine.schedules import upsert_declared

    workflows = list(workflows)
    with conn.transaction():
        for params in registration(workflows):
            conn.execute(QUERIES["graph_register"], params)
            conn.execute(QUERIES["workflow_register"], params)
        register_patches(conn, workflows, now=now)
        upsert_declared(conn, workflows, now=now)


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

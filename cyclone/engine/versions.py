"""Which graph versions a process's code can run: the one rule of what a VM may lease.

A run keeps the graph it was submitted with (by hash), while a worker runs a step with the
handler its own code has under the step's node name. So a VM leases a step only when its code
has every node a worker runs for that step's graph (same name, same kind, a child node naming
the same child workflow): its own current graphs, and older (or newer) versions that differ only
in what needs no handler (a timeout, retries, a sleep's length, a node it added). A version that
renamed or removed a node a worker runs is left to the VMs whose code has it; runs of a graph no
live VM serves wait and are reported (`cyclone status`, `cyclone_runs_unserved`), never failed.

The hashes go to the lease's candidate scan (`graphs`, migration 16), from `Served`, which
looks again every REFRESH_EVERY: another VM may register a version this code can run (a
rollback, a change of a timeout).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import psycopg

from cyclone.engine.graphs import graph_by_hash
from cyclone.sql import QUERIES
from cyclone.states import NodeKind
from cyclone.workflow import Graph, Workflow

Conn = psycopg.Connection[Any]

# Kinds whose steps a worker runs with code: the others (wait, sleep) the engine settles.
WORKER_KINDS = frozenset({NodeKind.TASK, NodeKind.MAP, NodeKind.CHILD})
# How often the versions this code can run are looked up again.
REFRESH_EVERY = 5.0


def runs_on(graph: Graph, code: Graph) -> bool:
    """Whether code whose graph is `code` has every node a worker runs for `graph`'s steps."""
    if graph.workflow != code.workflow:
        return False
    for name, spec in graph.nodes.items():
        if spec.kind not in WORKER_KINDS:
            continue
        have = code.nodes.get(name)
        if have is None or have.kind != spec.kind or have.child != spec.child:
            return False
    return True


def served_graphs(conn: Conn, workflows: Mapping[str, Workflow]) -> tuple[str, ...]:
    """The hashes of every stored graph of these workflows that their code can run (their
    current graphs first)."""
    return tuple(served_versions(conn, workflows))


def served_versions(conn: Conn, workflows: Mapping[str, Workflow]) -> dict[str, Graph]:
    """served_graphs, each hash with its graph."""
    out = {wf.graph.hash: wf.graph for wf in workflows.values()}
    if not out:
        return out
    rows = conn.execute(QUERIES["graph_versions"], {"names": sorted(workflows)}).fetchall()
    for row in rows:
        if row["hash"] in out:
            continue
        try:
            graph = graph_by_hash(conn, row["hash"])
        except (KeyError, TypeError, ValueError):  # GraphError too
            continue  # written by a Cyclone this one cannot read: not ours to run
        if runs_on(graph, workflows[row["workflow"]].graph):
            out[row["hash"]] = graph
    return out


class Served:
    """The graphs a registry's code can run, kept for REFRESH_EVERY between look-ups.

    Until the first look-up succeeds it holds the code's own current graphs, which it can
    always run: a failed look-up never widens what is leased.
    """

    def __init__(
        self,
        workflows: Mapping[str, Workflow],
        *,
        every: float = REFRESH_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workflows = workflows
        self.every = every
        self.clock = clock
        self.graphs: tuple[str, ...] = own_graphs(workflows.values())
        # Whether any of them limits a node's concurrency: a supervisor leasing for none such
        # sends the statement that leaves those steps out (steps_dispatch_plain).
        self.limited = any(limits_a_node(wf.graph) for wf in workflows.values())
        self.looked_at = float("-inf")

    def due(self) -> bool:
        return self.clock() - self.looked_at >= self.every

    def refresh(self, conn: Conn) -> tuple[str, ...]:
        """Look again (errors are the caller's: the hashes held stay as they were)."""
        self.looked_at = self.clock()
        versions = served_versions(conn, self.workflows)
        self.graphs = tuple(versions)
        self.limited = any(limits_a_node(graph) for graph in versions.values())
        return self.graphs

    def get(self, conn: Conn) -> tuple[str, ...]:
        """The hashes, looked up again on `conn` when due."""
        if self.due():
            self.refresh(conn)
        return self.graphs


def limits_a_node(graph: Graph) -> bool:
    """Whether a node of `graph` has a `concurrency` (its steps hold node slots)."""
    return any(spec.concurrency is not None for spec in graph.nodes.values())


def own_graphs(workflows: Iterable[Workflow]) -> tuple[str, ...]:
    return tuple(wf.graph.hash for wf in workflows)

"""A worker's side of a step: lease it, keep the lease, record what happened, fenced.

Every write names the lease token it holds. When the lease was revoked (run cancelled or past
its deadline) or reclaimed (it expired), the write matches no row, the transaction changes
nothing, and the function returns False: the late result is discarded.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from cyclone.db import encode_json, retrying, step_cursor, text_array
from cyclone.engine.advance import (
    RunRef,
    fail_run,
    make_steps,
    map_completed,
    node_completed,
    node_rows,
)
from cyclone.engine.graphs import current_graph, graph_by_hash
from cyclone.engine.runs import submit_runs
from cyclone.frozen import quick_init
from cyclone.sql import QUERIES
from cyclone.states import ErrorKind, NodeKind
from cyclone.workflow import Graph, NodeSpec, concurrency_key

Conn = psycopg.Connection[Any]

# Retry backoff: exponential from one second, capped at ten minutes, with jitter so that a
# burst of failures does not come back as a burst.
BACKOFF_BASE = 1.0
BACKOFF_CAP = 600.0
DEFAULT_LEASE_TTL = 30.0
# How long a connection may lease from after its last lease before it scans the candidate
# index from the start again, to find steps that became available behind that point: in the
# fair order (priority, pass, id) a run of a group with nothing queued, a chain's next step
# and a retry whose backoff ended all land behind it, so this bounds how late they start
# while the queue has a backlog (an idle queue scans from the start at once).
FULL_SCAN_EVERY = 0.05
# The parameters naming that point: the candidate index's leading key columns.
FLOOR_KEYS = ("after_priority", "after_pass", "after_id")


@quick_init
@dataclass(frozen=True, slots=True)
class Lease:
    """A leased step: what the worker needs to run it and to write its outcome."""

    step_id: int
    run_id: str
    workflow: str
    node: str
    kind: NodeKind
    attempt: int
    max_attempts: int
    token: str
    input: Any
    item_index: int | None
    item: Any
    deadline_at: datetime | None
    graph_hash: str
    # Seconds from the lease until the attempt must be dead: the smaller of the node's timeout
    # and the run's time left, both read on the database clock. None: unbounded.
    kill_after: float | None
    deadline_left: float | None
    lease_ttl: float
    parent_run_id: str | None = None
    # The node slot the lease holds (migration 33), when the supervisor's statement claimed
    # it: told back with the completion, which then lets it go without reading the row again.
    slot: int | None = None

    @property
    def is_fanout(self) -> bool:
        """A map row that has not yet evaluated its items."""
        return self.kind == NodeKind.MAP and self.item_index is None

    @property
    def run(self) -> RunRef:
        return RunRef(self.run_id, self.workflow, self.graph_hash)


def lease_step(
    conn: Conn,
    *,
    worker: str,
    workflows: Sequence[str] | None = None,
    lease_ttl: float = DEFAULT_LEASE_TTL,
    now: datetime | None = None,
    graphs: Sequence[str] | None = None,
) -> Lease | None:
    """Lease the oldest due step (of these workflows, and of runs of these graph hashes:
    those the caller's code can run, engine/versions.py; when given), or None.

    Like `complete_and_lease`, it runs on the connection's reused cursor (`step_cursor`): call
    it from one thread per connection, as psycopg cursors are not shared between threads.
    """
    params = _lease_params(worker, workflows, lease_ttl, now, lease=True, graphs=graphs)
    floor = _LeaseFloor.of(conn)
    while True:
        params.update(floor.params())
        row = step_cursor(conn).execute(QUERIES["step_lease"], params).fetchone()
        if not floor.taken(row):
            return _lease_from_row(row, lease_ttl)


_FLOOR = "_cyclone_lease_floor"


class _LeaseFloor:
    """Where a connection's last lease was in the candidate index, so the next starts there.

    Leased steps leave their index entries behind until VACUUM removes them; a lease scanning
    from the start walks them all (tens of thousands between autovacuums after a burst).
    Starting after the last lease skips them, and skips too the steps that became available
    behind that point (see FULL_SCAN_EVERY): a lease that finds nothing from the point, and
    any lease once FULL_SCAN_EVERY has passed, scans from the start. Kept on the connection,
    like its step cursor.
    """

    __slots__ = ("after", "full_at", "hinted")

    def __init__(self) -> None:
        self.after: tuple[int, int, int] | None = None
        self.full_at = 0.0
        self.hinted = False

    @classmethod
    def of(cls, conn: Conn) -> _LeaseFloor:
        floor: _LeaseFloor | None = getattr(conn, _FLOOR, None)
        if floor is None:
            floor = cls()
            setattr(conn, _FLOOR, floor)
        return floor

    def params(self) -> dict[str, Any]:
        now = time.monotonic()
        self.hinted = self.after is not None and now - self.full_at < FULL_SCAN_EVERY
        if not self.hinted:
            self.full_at = now
        after = self.after if self.hinted else None
        return dict(zip(FLOOR_KEYS, after or (None, None, None), strict=True))

    def taken(self, row: dict[str, Any] | None) -> bool:
        """Record the lease in `row`; True when a scan from the start must follow (a scan
        from the point found nothing)."""
        if row is not None and row.get("id") is not None:
            self.after = (row["priority"], row["pass"], row["id"])
            return False
        retry = self.hinted
        self.after = None
        return retry


def _lease_params(
    worker: str | None,
    workflows: Sequence[str] | None,
    lease_ttl: float,
    now: datetime | None,
    *,
    lease: bool,
    other_than: str | None = None,
    graphs: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Parameters of the `_lease_next` fragment every lease and fast completion ends with;
    `other_than`: a run none of whose steps may be leased (the one being completed)."""
    return {
        "lease": lease,
        "other_than": other_than,
        "worker": worker,
        "workflows": text_array(tuple(workflows)) if workflows is not None else None,
        "graphs": text_array(tuple(graphs)) if graphs is not None else None,
        "ttl": lease_ttl,
        "now": now,
    }


# The kinds by value: NodeKind(value) goes through the enum's metaclass, on every lease.
_NODE_KINDS = {kind.value: kind for kind in NodeKind}


def _lease_from_row(row: dict[str, Any], lease_ttl: float) -> Lease | None:
    """The lease the `_lease_next` fragment's row carries, or None when it took none."""
    if row["id"] is None:
        return None
    return Lease(
        step_id=row["id"],
        run_id=row["run_id"],
        workflow=row["workflow"],
        node=row["node"],
        kind=_NODE_KINDS.get(row["kind"]) or NodeKind(row["kind"]),
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        token=row["lease_token"],
        input=row["input"],
        item_index=row["item_index"],
        item=row["item"],
        deadline_at=row["deadline_at"],
        graph_hash=row["graph_hash"],
        kill_after=row["kill_after"],
        deadline_left=row["deadline_left"],
        lease_ttl=lease_ttl,
        parent_run_id=row["parent_run_id"],
        slot=row.get("slot"),
    )


def heartbeat(
    conn: Conn,
    step_id: int,
    token: str,
    *,
    lease_ttl: float = DEFAULT_LEASE_TTL,
    now: datetime | None = None,
) -> bool:
    """Extend the lease; False when it is no longer ours."""
    row = conn.execute(
        QUERIES["step_heartbeat"],
        {"step_id": step_id, "token": token, "ttl": lease_ttl, "now": now},
    )
    return row.fetchone() is not None


def complete_step(
    conn: Conn,
    lease: Lease,
    output: Any,
    *,
    now: datetime | None = None,
    encoded: str | None = None,
) -> bool:
    """Record the step's output and advance its run, in one transaction.

    `encoded` is the output already encoded as JSON (the runner checks it before recording).
    """
    params = _completion_params(lease, output, encoded, now)
    graph = graph_by_hash(conn, lease.graph_hash)
    fast = _fast_completion(graph, lease)
    if fast is None:
        return _complete_general(conn, lease, graph, params, now)
    nothing_next = _lease_params(None, None, lease.lease_ttl, now, lease=False)
    no_floor = dict.fromkeys(FLOOR_KEYS)
    return _complete_fast(conn, fast, {**params, **nothing_next, **no_floor})[0]


def complete_and_lease(
    conn: Conn,
    lease: Lease,
    output: Any,
    *,
    worker: str,
    workflows: Sequence[str] | None = None,
    lease_ttl: float = DEFAULT_LEASE_TTL,
    now: datetime | None = None,
    encoded: str | None = None,
    graphs: Sequence[str] | None = None,
) -> tuple[bool, Lease | None]:
    """Complete this step and lease the next due one, in one statement where the step allows.

    Returns (whether the completion was recorded, the next lease or None). A lost lease
    records nothing and leases nothing. Steps without a one-statement completion (joins, map
    items, child runs) are completed, then the next step leased, as two statements. One
    thread per connection: see `lease_step`.
    """
    params = _completion_params(lease, output, encoded, now)
    graph = graph_by_hash(conn, lease.graph_hash)
    fast = _fast_completion(graph, lease)
    if fast is None:
        done = _complete_general(conn, lease, graph, params, now)
        nxt = lease_step(conn, worker=worker, workflows=workflows, lease_ttl=lease_ttl, now=now,
                         graphs=graphs)  # fmt: skip
        return done, nxt
    lease_next = _lease_params(
        worker, workflows, lease_ttl, now, lease=True, other_than=lease.run_id, graphs=graphs
    )
    floor = _LeaseFloor.of(conn)
    done, row = _complete_fast(conn, fast, {**params, **lease_next, **floor.params()})
    if done and floor.taken(row):
        # Nothing after the last lease: look from the start, in a statement of its own.
        return done, lease_step(conn, worker=worker, workflows=workflows, lease_ttl=lease_ttl,
                                now=now, graphs=graphs)  # fmt: skip
    return done, _lease_from_row(row, lease_ttl)


def _completion_params(
    lease: Lease, output: Any, encoded: str | None, now: datetime | None
) -> dict[str, Any]:
    text = encoded if encoded is not None else encode_json(output, f"output of {lease.node}")
    return {
        "run_id": lease.run_id,
        "step_id": lease.step_id,
        "token": lease.token,
        "output": text,
        "now": now,
    }


def _complete_general(
    conn: Conn, lease: Lease, graph: Graph, params: dict[str, Any], now: datetime | None
) -> bool:
    """The completion of any step: fenced, then the run advanced, in one transaction."""

    def tx() -> bool:
        with conn.transaction():
            row = conn.execute(QUERIES["step_complete"], params).fetchone()
            if row is None:
                return False
            if lease.kind != NodeKind.MAP or map_completed(conn, lease.run_id, lease.node):
                node_completed(conn, lease.run, graph, lease.node, now)
            return True

    return retrying(tx)


def _complete_fast(
    conn: Conn, fast: tuple[str, dict[str, Any]], params: dict[str, Any]
) -> tuple[bool, dict[str, Any]]:
    """Run a one-statement completion; (whether it was recorded, its row with any next lease)."""
    query, extra = fast
    row = retrying(
        lambda: step_cursor(conn).execute(QUERIES[query], {**params, **extra}).fetchone()
    )
    return bool(row["completed"]), row


FastCompletion = tuple[str, dict[str, Any]] | None
# Decided once per graph, node and whether the run is a child: this is on every step's path.
_FAST: dict[tuple[str, str, bool], FastCompletion] = {}


def _fast_completion(graph: Graph, lease: Lease) -> FastCompletion:
    """The one-statement completion that fits this step, if one does.

    A task whose downstream nodes depend on it alone needs nothing else of the run to make
    their steps; the only sink of a graph completes its run (every other node is its ancestor).
    Everything else (joins, map items, waits that may take a kept signal, child runs reporting
    to a parent) goes through the general path.
    """
    if lease.kind != NodeKind.TASK:
        return None
    key = (graph.hash, lease.node, lease.parent_run_id is None)
    if key not in _FAST:
        _FAST[key] = _decide_fast(graph, lease.node, top_level=key[2])
    return _FAST[key]


def _decide_fast(graph: Graph, node: str, *, top_level: bool) -> FastCompletion:
    down = [graph.nodes[d] for d in graph.downstream[node]]
    if down:
        if all(s.after == (node,) and s.kind != NodeKind.WAIT for s in down):
            return "step_complete_chain", {"next": _next_nodes_json(down)}
        return None
    if graph.sinks == (node,) and top_level:
        return "step_complete_last", {}
    return None


def _next_nodes_json(specs: Sequence[NodeSpec]) -> str:
    """The steps to make after a node, as one JSON parameter (cheaper to send than six arrays)."""
    rows = node_rows(specs)
    keys = {
        "nodes": "node",
        "kinds": "kind",
        "max_attempts": "max_attempts",
        "timeouts": "timeout",
        "signals": "signal",
        "dues": "due",
        "limits": "node_limit",
        "rates": "rate_limit",
    }
    return json.dumps([{keys[k]: rows[k][i] for k in keys} for i in range(len(specs))])


def fail_step(
    conn: Conn,
    step_id: int,
    token: str,
    *,
    kind: ErrorKind | str,
    error: str,
    retry: bool | None = None,
    now: datetime | None = None,
) -> bool:
    """Record a failed attempt: retried with backoff while attempts remain, else dead.

    `retry` defaults to what the error kind says; a dead step fails its run.
    """
    kind = ErrorKind(kind)
    if retry is None:
        retry = kind.retried

    def tx() -> bool:
        with conn.transaction():
            row = conn.execute(
                QUERIES["step_fail"],
                {
                    "step_id": step_id,
                    "token": token,
                    "kind": str(kind),
                    "error": error,
                    "retry": retry,
                    "backoff_base": BACKOFF_BASE,
                    "backoff_cap": BACKOFF_CAP,
                    "now": now,
                },
            ).fetchone()
            if row is None:
                return False
            if row["state"] == "dead":
                fail_run(conn, str(row["run_id"]), now)
            return True

    return retrying(tx)


def expand_map(
    conn: Conn, lease: Lease, items: Sequence[Any], *, now: datetime | None = None
) -> bool:
    """Turn a map's fan-out row into one step per item (none: the node completes with [])."""
    what = f"items of {lease.workflow}/{lease.node}"
    texts = [encode_json(item, f"{what}[{i}]") for i, item in enumerate(items)]
    if not texts:
        return complete_step(conn, lease, [], now=now)

    def tx() -> bool:
        with conn.transaction():
            row = conn.execute(
                QUERIES["step_release_items"],
                {
                    "run_id": lease.run_id,
                    "step_id": lease.step_id,
                    "token": lease.token,
                    "item": texts[0],
                    "now": now,
                },
            ).fetchone()
            if row is None:
                return False
            if len(texts) > 1:
                conn.execute(
                    QUERIES["step_insert_items"],
                    {
                        "step_id": lease.step_id,
                        "indexes": list(range(1, len(texts))),
                        "items": texts[1:],
                        "now": now,
                    },
                )
            return True

    return retrying(tx)


def start_child(
    conn: Conn,
    lease: Lease,
    child_workflow: str,
    child_input: Any,
    *,
    max_wait: float | None,
    now: datetime | None = None,
) -> str | None:
    """Submit the child run of a child node and park the node on it; returns the child's id."""
    text = encode_json(child_input, f"input of child {child_workflow}")

    def tx() -> str | None:
        with conn.transaction():
            graph = current_graph(conn, child_workflow)
            child_id = str(uuid.uuid4())
            row = conn.execute(
                QUERIES["step_park_child"],
                {
                    "run_id": lease.run_id,
                    "step_id": lease.step_id,
                    "token": lease.token,
                    "child_run_id": child_id,
                    "max_wait": max_wait,
                    "now": now,
                },
            ).fetchone()
            if row is None:
                return None
            keyed = child_concurrency(conn, child_workflow, child_input)
            if keyed is not None:
                # As a client's submit: the key's lock in a statement before the count.
                conn.execute(
                    QUERIES["concurrency_lock"], {"workflow": graph.workflow, "ckeys": [keyed[0]]}
                )
            submit_runs(
                conn,
                graph.workflow,
                graph.hash,
                [child_id],
                [text],
                [graph.nodes[n] for n in graph.roots],
                parent=(lease.run_id, lease.step_id),
                now=now,
                ckeys=[keyed[0]] if keyed else None,
                climit=keyed[1] if keyed else None,
            )
            return child_id

    return retrying(tx)


def child_concurrency(conn: Conn, workflow: str, child_input: Any) -> tuple[str, int] | None:
    """A child run's concurrency key and limit, when its workflow has a limit keyed by an input
    field (as registered: a key computed in code is known only to the submitting client, and
    such a child run is not counted). A child input without the field fails the node."""
    row = conn.execute(QUERIES["workflow_get"], {"workflow": workflow}).fetchone()
    if row is None or row["concurrency_limit"] is None or row["concurrency_field"] is None:
        return None
    return concurrency_key(row["concurrency_field"], child_input), row["concurrency_limit"]


def release_step(conn: Conn, step_id: int, token: str, *, now: datetime | None = None) -> bool:
    """Give a leased step back, attempt not spent (its worker was stopped by a shutdown)."""
    row = conn.execute(QUERIES["step_release"], {"step_id": step_id, "token": token, "now": now})
    return row.fetchone() is not None


# What `revoked_leases` says of a lease its holder ended itself by recording the step.
FINISHED = "finished"


def revoked_leases(conn: Conn, held: Mapping[int, str]) -> dict[int, str | None]:
    """Of the (step id -> token) leases held, those no longer valid, with why: the step's error
    kind (None when unknown: the step is gone or its run ended), or FINISHED when the holder
    recorded it itself (its report may still be on its way)."""
    if not held:
        return {}
    rows = conn.execute(
        QUERIES["step_revoked"],
        {
            "step_ids": list(held),
            "tokens": list(held.values()),
        },
    ).fetchall()
    return {r["step_id"]: r["reason"] for r in rows}


__all__ = [
    "FINISHED",
    "Lease",
    "complete_and_lease",
    "complete_step",
    "expand_map",
    "fail_step",
    "heartbeat",
    "lease_step",
    "make_steps",
    "release_step",
    "revoked_leases",
    "start_child",
]

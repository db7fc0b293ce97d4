"""Leasing for several workers at once: the supervisor's side of a step.

A supervisor's workers hand it the tasks they finished and ask it for their next step; it
records the finished ones and leases for every worker that waits in one statement
(`steps_dispatch`), so that what a statement costs PostgreSQL whatever it does (parse, plan,
executor start-up, commit) is paid once for all of them. The rules are the single statements'
rules: a completion goes through only under its lease token, the steps after it are made in the
same transaction, and a lease is taken from the same candidate scan.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from cyclone import codec
from cyclone.db import check_json, encode_json, loads_flat, retrying, step_cursor, text_array
from cyclone.engine.graphs import graph_by_hash
from cyclone.engine.steps import (
    DEFAULT_LEASE_TTL,
    Lease,
    _fast_completion,
    _lease_from_row,
    _LeaseFloor,
)
from cyclone.errors import PayloadTooDeep
from cyclone.frozen import quick_init
from cyclone.sql import QUERIES, numbered

log = logging.getLogger(__name__)

Conn = psycopg.Connection[Any]


@quick_init
@dataclass(frozen=True, slots=True)
class Finished:
    """A task a worker finished, to be completed by `dispatch`.

    `output` is the value the handler returned; `next` the steps to make after it (JSON text
    of the rows, as step_complete_chain takes them), or None when the step is its run's last.
    `slot`: the node slot its lease row named (None: none, or not known).
    """

    step_id: int
    token: str
    run_id: str
    output: Any
    next: Any = None
    last: bool = False
    slot: int | None = None


def finished_json(conn: Conn, lease: Lease, encoded: str) -> str | None:
    """A `Finished` as the JSON object a worker's `want` line carries, made from
    the output already encoded (the worker's encoder checked it), or None as there."""
    fast = _fast_completion(graph_by_hash(conn, lease.graph_hash), lease)
    if fast is None:
        return None
    query, extra = fast
    last = query == "step_complete_last"
    nxt = "null" if last else extra["next"]
    slot = "" if lease.slot is None else f'"slot":{int(lease.slot)},'
    return (
        f'{{"step_id":{lease.step_id},"token":"{lease.token}","run_id":"{lease.run_id}",'
        f'"last":{"true" if last else "false"},{slot}"next":{nxt},"output":{encoded}}}'
    )


def finished_of(conn: Conn, lease: Lease, output: Any) -> Finished | None:
    """The completion `dispatch` can record for this lease, or None when the step needs the
    general path (joins, map items, waits that may take a kept signal, child runs)."""
    text = finished_json(conn, lease, encode_json(output, f"output of {lease.node}"))
    return None if text is None else Finished(**codec.loads(text))


@quick_init
@dataclass(frozen=True, slots=True)
class Dispatched:
    """What one statement did: the steps it completed, and a lease row per worker served
    (by the worker's position in the names given, from 0)."""

    completed: frozenset[int]
    leases: dict[int, dict[str, Any]]

    @classmethod
    def parse(cls, text: str) -> Dispatched:
        """From the statement's one JSON value."""
        found = codec.loads(text)
        leases = {row["worker"] - 1: row for row in found["leases"]}
        return cls(frozenset(found["completed"]), leases)

    @classmethod
    def parse_flat(cls, text: str) -> Dispatched:
        """The same, from an answer nested too deep for `parse` (a row written past the
        client's checks): read without recursion, with the leases of rows nested deeper than
        MAX_JSON_DEPTH left out. No worker could read those, so they are not handed out: each
        lapses, and the scanner reclaims it, an attempt spent, until the step is dead."""
        found = loads_flat(text)
        leases = {}
        for row in found["leases"]:
            try:
                check_json(row, f"step {row.get('id')}")
            except PayloadTooDeep as exc:
                log.warning("%s; its lease is not handed to a worker", exc)
                continue
            leases[row["worker"] - 1] = row
        return cls(frozenset(found["completed"]), leases)

    def last(self) -> dict[str, Any] | None:
        """The lease furthest along the candidate index (for the session's _LeaseFloor)."""
        return max(
            self.leases.values(), key=lambda r: (r["priority"], r["pass"], r["id"]), default=None
        )


# steps_dispatch with $n placeholders, and the names of its parameters in their order: the
# supervisor sends it through libpq directly, several sessions at once (supervisor/dispatch.py).
DISPATCH_SQL, DISPATCH_PARAMS = numbered(QUERIES["steps_dispatch"])
# The same with the steps of no node limit alone, for a supervisor whose graphs limit none.
DISPATCH_PLAIN_SQL, _PLAIN_PARAMS = numbered(QUERIES["steps_dispatch_plain"])
assert _PLAIN_PARAMS == DISPATCH_PARAMS, "the two statements take the same parameters"


# steps_release likewise: leases taken ahead, given back.
RELEASE_SQL, RELEASE_PARAMS = numbered(QUERIES["steps_release"])


def release_params(leases: Sequence[tuple[int, str]]) -> dict[str, str | None]:
    """steps_release's parameters for (step id, lease token) pairs, as text."""
    return {
        "step_ids": "{" + ",".join(str(step_id) for step_id, _ in leases) + "}",
        "tokens": "{" + ",".join(token for _, token in leases) + "}",
        "now": None,
    }


def release(conn: Conn, leases: Sequence[tuple[int, str]]) -> int:
    """Give back leases taken ahead, their attempts not spent, in one statement (waiting for
    it: the supervisor does so only as it stops); how many went back."""
    row = conn.execute(QUERIES["steps_release"], release_params(leases)).fetchone()
    return int(row["result"])


def dispatch_params(
    finished: Sequence[Finished],
    workers: Sequence[str],
    *,
    workflows: Sequence[str] | None,
    lease_ttl: float,
    now: datetime | None = None,
    graphs: Sequence[str] | None = None,
) -> dict[str, str | None]:
    """steps_dispatch's parameters, each as the text PostgreSQL reads (casts are in the SQL)."""
    rows = [
        {"step_id": f.step_id, "token": f.token, "run_id": f.run_id, "last": f.last,
         "output": f.output, "next": f.next, "slot": f.slot}
        for f in finished
    ]  # fmt: skip
    return {
        "done": codec.dumps(rows),
        "step_ids": "{" + ",".join(str(f.step_id) for f in finished) + "}",
        "last_runs": "{" + ",".join(f.run_id for f in finished if f.last) + "}",
        "want": str(len(workers)),
        "workers": text_array(tuple(workers)),
        "workflows": text_array(tuple(workflows)) if workflows is not None else None,
        "graphs": text_array(tuple(graphs)) if graphs is not None else None,
        "ttl": repr(float(lease_ttl)),
        "now": now.isoformat() if now is not None else None,
    }


def floor_params(floor: _LeaseFloor) -> dict[str, str | None]:
    """Where the session's last lease was (see _LeaseFloor), as text."""
    return {k: None if v is None else str(v) for k, v in floor.params().items()}


def dispatch(
    conn: Conn,
    finished: Sequence[Finished],
    workers: Sequence[str],
    *,
    workflows: Sequence[str] | None = None,
    lease_ttl: float = DEFAULT_LEASE_TTL,
    now: datetime | None = None,
    graphs: Sequence[str] | None = None,
    limited: bool = True,
) -> Dispatched:
    """Complete `finished` and lease at most one step for each of `workers`, in one statement,
    waiting for it (the supervisor sends the same statement without waiting). `limited` false:
    no step of a node limited by concurrency is leased (steps_dispatch_plain), for callers
    whose `graphs` limit no node.

    Like `lease_step`, it keeps its place in the candidate index on the connection; when a
    scan from that place finds nothing, a second statement (leasing only) scans from the start.
    """
    params = dispatch_params(
        finished, workers, workflows=workflows, lease_ttl=lease_ttl, now=now, graphs=graphs
    )
    query = QUERIES["steps_dispatch" if limited else "steps_dispatch_plain"]
    floor = _LeaseFloor.of(conn)
    completed: frozenset[int] = frozenset()
    while True:
        params.update(floor_params(floor))
        row = retrying(lambda: step_cursor(conn).execute(query, params).fetchone())
        result = Dispatched.parse(row["result"])
        completed = completed | result.completed
        if not workers or not floor.taken(result.last()):
            return Dispatched(completed, result.leases)
        # Nothing after the last lease: look from the start, completing nothing twice.
        params.update(done="[]", step_ids="{}", last_runs="{}")


def aged(row: dict[str, Any], age: float) -> dict[str, Any]:
    """A lease row taken `age` seconds ago, as a worker starts its step now: the run's deadline
    is that much nearer (the arbiter and the worker count what is left from now); the step's
    timeout, which bounds the attempt, is counted from now."""
    left, kill_after = row["deadline_left"], row["kill_after"]
    if left is None:
        return row
    if kill_after is not None and kill_after >= left:
        kill_after = kill_after - age  # the deadline is what kills it
    return {**row, "deadline_left": left - age, "kill_after": kill_after}


def lease_of(row: dict[str, Any], lease_ttl: float) -> Lease:
    """The Lease a worker runs, from a lease row of `dispatch` (its times as JSON wrote them)."""
    deadline = row["deadline_at"]
    if isinstance(deadline, str):
        row = {**row, "deadline_at": datetime.fromisoformat(deadline)}
    lease = _lease_from_row(row, lease_ttl)
    assert lease is not None, "a lease row of dispatch always names its step"
    return lease

"""Re-driving the DLQ: a dead step is retried, and its failed run runs again.

A dead step has failed its run, and the failure discarded the run's other live steps. Retrying
one of them therefore re-drives the whole run, in one transaction, locking the run before its
steps as every writer does:

    run    failed  ──retry──▶  running (finished_at NULL; a new deadline_at with `deadline`)
    steps  dead, discarded ──▶ available (tasks, maps, child nodes: attempts reset)
                             ╰▶ waiting   (waits and sleeps, with a fresh due_at)

Every dead step of the run comes back, not only the one named: a run that still had a dead
step would be running and failed at once. Steps come back in place (same row, same node
instance), so map items keep their index and the one-step-per-node-instance index holds;
nodes that never got a step get one as their dependencies complete, as always.

Refused (RetryRefused): a step that is not dead, a run that is not failed (completed,
cancelled, or already re-driven), a run whose deadline failed it unless a new `deadline` is
given, a deadline on a child run (child runs have none of their own), a child run whose
parent has ended (retry the parent's child node instead, which starts a new child run), and
a run whose concurrency key has as many active runs as its limit (it would run beside them).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from cyclone.db import is_step_id, retrying
from cyclone.engine.advance import RunRef, consume_signal, node_rows
from cyclone.engine.graphs import graph_by_hash
from cyclone.engine.runs import lock_run
from cyclone.errors import CycloneError, StepNotFound
from cyclone.sql import QUERIES
from cyclone.states import MAX_DEADLINE_SECONDS, NodeKind

Conn = psycopg.Connection[Any]


class RetryRefused(CycloneError):
    """The step cannot be retried as things stand; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Retried:
    """What a retry changed: the run, its deadline, and the steps that came back."""

    run_id: str
    workflow: str
    deadline_at: datetime | None
    step_ids: tuple[int, ...]


def retry_dead_step(
    conn: Conn, step_id: int, *, deadline: float | None = None, now: datetime | None = None
) -> Retried:
    """Retry dead step `step_id`: its run runs again (see the module docstring).

    `deadline` (seconds, > 0) gives the run a new deadline from now; a run failed by its
    deadline needs one.
    """
    if not is_step_id(step_id):
        raise StepNotFound(f"no step {step_id!r}")
    if deadline is not None and not 0 < deadline <= MAX_DEADLINE_SECONDS:
        raise ValueError(f"deadline: expected seconds > 0, got {deadline!r}")

    def tx() -> Retried:
        with conn.transaction():
            owner = conn.execute(QUERIES["dlq_step_owner"], {"step_id": step_id}).fetchone()
            if owner is None:
                raise StepNotFound(f"no step {step_id}")
            lock_run(conn, owner["run_id"])
            row = conn.execute(
                QUERIES["dlq_retry_check"], {"step_id": step_id, "now": now}
            ).fetchone()
            _check(row, deadline)
            _check_key(conn, row)
            return _redrive(conn, row, deadline, now)

    return retrying(tx)


def _check(row: dict[str, Any], deadline: float | None) -> None:
    step, run = row["step_id"], row["run_id"]
    if row["step_state"] != "dead":
        raise RetryRefused(f"step {step} is {row['step_state']}, not dead: nothing to retry")
    if row["run_state"] != "failed":
        raise RetryRefused(f"step {step}: its run {run} is {row['run_state']}, not failed")
    if row["parent_run_id"] is not None:
        if row["parent_state"] not in ("running", "paused"):
            raise RetryRefused(
                f"step {step} belongs to child run {run}, whose parent run "
                f"{row['parent_run_id']} is {row['parent_state']}: retry the parent's dead "
                "step instead (its child node starts a new child run)"
            )
        if deadline is not None:
            raise RetryRefused(f"run {run} is a child run: it has no deadline of its own")
    if deadline is None and (row["past_deadline"] or row["deadline_killed"]):
        raise RetryRefused(
            f"run {run} was failed by its deadline: retrying needs a new one "
            f"(cyclone dlq retry {step} --deadline 30m)"
        )


def _check_key(conn: Conn, row: dict[str, Any]) -> None:
    """A re-driven run takes a slot of its key at once: refuse it when the key has none free."""
    limit = row["concurrency_limit"]
    if limit is None:
        return
    workflow, key = row["workflow"], row["concurrency_key"]
    conn.execute(QUERIES["concurrency_lock"], {"workflow": workflow, "ckeys": [key]})
    active = conn.execute(QUERIES["dlq_key_active"], {"workflow": workflow, "key": key})
    count = active.fetchone()["active"]
    if count >= limit:
        raise RetryRefused(
            f"run {row['run_id']}: its concurrency key {key!r} of workflow {workflow} has "
            f"{count} active run(s), and its limit is {limit}: retry it once one of them ends"
        )


def _redrive(
    conn: Conn, row: dict[str, Any], deadline: float | None, now: datetime | None
) -> Retried:
    run = conn.execute(
        QUERIES["dlq_run_redrive"], {"run_id": row["run_id"], "deadline": deadline, "now": now}
    ).fetchone()
    ref = RunRef(str(run["id"]), run["workflow"], run["graph_hash"])
    graph = graph_by_hash(conn, ref.graph_hash)
    rows = node_rows(list(graph.nodes.values()))
    steps = conn.execute(
        QUERIES["dlq_steps_redrive"],
        {"run_id": ref.id, "nodes": rows["nodes"], "dues": rows["dues"], "now": now},
    ).fetchall()
    # A wait that waits again takes a signal kept for it, as a newly reached wait does.
    for step in steps:
        if step["kind"] == NodeKind.WAIT and step["signal"] is not None:
            consume_signal(conn, ref, graph, step["id"], step["signal"], now)
    return Retried(
        run_id=ref.id,
        workflow=ref.workflow,
        deadline_at=run["deadline_at"],
        step_ids=tuple(sorted(s["id"] for s in steps)),
    )


__all__ = ["Retried", "RetryRefused", "retry_dead_step"]

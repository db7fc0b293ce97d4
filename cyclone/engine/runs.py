"""A run's own operations: submit runs, lock one, cancel a tree of them.

Like advance.py, every function here runs inside the caller's transaction; `lock_run` is how a
caller takes the run before changing it. advance.py stands on this module, never the other way
(failing a run reaches its parent run's graph: that is `advance.fail_run`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import psycopg

from cyclone.engine.graphs import node_rows
from cyclone.sql import QUERIES
from cyclone.states import ErrorKind

Conn = psycopg.Connection[Any]


def submit_runs(
    conn: Conn,
    workflow: str,
    graph_hash: str,
    ids: list[str],
    inputs: list[str],
    roots: Sequence[Any],
    **options: Any,
) -> list[str]:
    """Insert runs and their root steps (one statement); returns the ids actually inserted.

    `options` are submit_params's: deadline, key, parent, now.
    """
    params = submit_params(workflow, graph_hash, ids, inputs, roots, **options)
    rows = conn.execute(QUERIES["run_submit"], params).fetchall()
    return [str(r["id"]) for r in rows]


def submit_params(
    workflow: str,
    graph_hash: str,
    ids: list[str],
    inputs: list[str],
    roots: Sequence[Any],
    *,
    deadline: float | None = None,
    key: str | None = None,
    parent: tuple[str, int] | None = None,
    now: datetime | None = None,
    priority: int | None = None,
    ckeys: list[str | None] | None = None,
    climit: int | None = None,
    trace_parent: str | None = None,
) -> dict[str, Any]:
    """The parameters of run_submit (the clients' submits run it too). `priority`: None takes
    the workflow's; `ckeys`: each run's concurrency key (None: no key), counted against
    `climit` (the caller ran concurrency_lock for them first, in the same transaction);
    `trace_parent`: the W3C traceparent to store (None: a child run takes its parent's)."""
    return {
        "workflow": workflow,
        "hash": graph_hash,
        "ids": ids,
        "inputs": inputs,
        "key": key,
        "parent_run_id": parent[0] if parent else None,
        "parent_step_id": parent[1] if parent else None,
        "deadline": deadline or 0.0,
        "now": now,
        "priority": priority,
        "ckeys": ckeys,
        "climit": climit if ckeys else None,
        "trace_parent": trace_parent,
        **node_rows(roots),
    }


def lock_run(conn: Conn, run_id: str) -> dict[str, Any] | None:
    return conn.execute(QUERIES["run_lock"], {"run_id": run_id}).fetchone()


def describe_failure(conn: Conn, run_id: str) -> str:
    row = conn.execute(QUERIES["run_get"], {"run_id": run_id}).fetchone()
    failure = (row or {}).get("failure") or {}
    return f"{failure.get('error_kind', 'error')}: {failure.get('error', '')}".rstrip(": ")


def cancel_runs(
    conn: Conn, run_ids: Iterable[str], now: datetime | None, *, notify: bool = True
) -> list[dict[str, Any]]:
    """Cancel these runs and their descendants; returns the runs that changed."""
    rows = conn.execute(
        QUERIES["run_cancel_tree"], {"run_ids": list(run_ids), "now": now}
    ).fetchall()
    if rows:
        ended = [str(r["id"]) for r in rows]
        settle_late(conn, ended, "discarded", ErrorKind.CANCELLED, "run cancelled", now)
    if rows and notify:
        notify_revoked(conn)
    return rows


def settle_late(
    conn: Conn,
    run_ids: list[str],
    state: str,
    kind: str | None,
    error: str,
    now: datetime | None,
) -> None:
    """Give steps inserted by a concurrent chain completion their ended run's fate."""
    conn.execute(
        QUERIES["steps_settle_late"],
        {"run_ids": run_ids, "state": state, "kind": kind, "error": error, "now": now},
    )


def notify_revoked(conn: Conn) -> None:
    conn.execute(QUERIES["revoked_notify"])

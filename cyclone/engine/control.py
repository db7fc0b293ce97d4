"""Operations on whole runs from outside: cancel, pause, resume, signal."""

from __future__ import annotations

import warnings
from datetime import datetime
from typing import Any

import psycopg

from cyclone.db import check_text, encode_json, retrying
from cyclone.engine.advance import RunRef, child_finished, settle_waiting
from cyclone.engine.graphs import graph_by_hash
from cyclone.engine.runs import cancel_runs, lock_run
from cyclone.errors import RunNotFound, UnheardSignal
from cyclone.sql import QUERIES
from cyclone.states import NodeKind

Conn = psycopg.Connection[Any]
_LIVE = ("running", "paused", "queued")


def _locked(conn: Conn, run_id: str) -> dict[str, Any]:
    run = lock_run(conn, _uuid(run_id))
    if run is None:
        raise RunNotFound(f"no run {run_id!r}")
    return run


def _uuid(run_id: str) -> str:
    import uuid

    try:
        return str(uuid.UUID(str(run_id)))
    except ValueError:
        raise RunNotFound(f"no run {run_id!r} (not a run id)") from None


def cancel_run(conn: Conn, run_id: str, *, now: datetime | None = None) -> bool:
    """Cancel the run and its child runs; its handlers are killed. False if already finished."""

    def tx() -> bool:
        with conn.transaction():
            run = _locked(conn, run_id)
            if run["state"] not in _LIVE:
                return False
            cancel_runs(conn, [run["id"]], now)
            if run["parent_run_id"] is not None:
                child_finished(
                    conn,
                    run["parent_run_id"],
                    run["parent_step_id"],
                    str(run["id"]),
                    now,
                    failure="was cancelled",
                )
            return True

    return retrying(tx)


def pause_run(conn: Conn, run_id: str, *, now: datetime | None = None) -> bool:
    with conn.transaction():
        _locked(conn, run_id)
        row = conn.execute(QUERIES["run_pause"], {"run_id": _uuid(run_id), "now": now})
        return row.fetchone() is not None


def resume_run(conn: Conn, run_id: str, *, now: datetime | None = None) -> bool:
    with conn.transaction():
        _locked(conn, run_id)
        row = conn.execute(QUERIES["run_resume"], {"run_id": _uuid(run_id), "now": now})
        resumed = row.fetchone() is not None
        if resumed:
            # A run paused while it waited for a slot goes back to the queue: a slot may
            # have freed meanwhile.
            conn.execute(QUERIES["run_admit"], {"run_id": _uuid(run_id), "now": now})
            # Its ready steps were there all along, unchanged: no trigger tells a supervisor
            # waiting for work that they can be leased again.
            conn.execute(QUERIES["wake_ready"])
        return resumed


def signal_run(
    conn: Conn, run_id: str, name: str, payload: Any = None, *, now: datetime | None = None
) -> bool:
    """Deliver a signal to the wait that expects it, or keep it until that wait is reached.

    False when the run has already finished.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a signal needs a non-empty name, got {name!r}")
    check_text(name, "signal name")
    text = encode_json(payload, f"payload of signal {name!r}")

    def tx() -> bool:
        with conn.transaction():
            run = _locked(conn, run_id)
            if run["state"] not in _LIVE:
                return False
            ref = RunRef(str(run["id"]), run["workflow"], run["graph_hash"])
            step = conn.execute(
                QUERIES["step_waiting_for_signal"], {"run_id": ref.id, "name": name}
            ).fetchone()
            conn.execute(
                QUERIES["signal_insert"],
                {
                    "run_id": ref.id,
                    "name": name,
                    "payload": text,
                    "now": now,
                    "consumed_by": step["id"] if step else None,
                },
            )
            if step is not None:
                import json

                settle_waiting(conn, ref, None, step["id"], json.loads(text), now)
            elif name not in listened(conn, ref.graph_hash):
                unheard.append(ref)
            return True

    unheard: list[RunRef] = []
    sent = retrying(tx)
    if unheard:
        warn_unheard(conn, unheard[-1], name)
    return sent


def listened(conn: Conn, graph_hash: str) -> set[str]:
    """The signal names the wait nodes of a graph listen for."""
    graph = graph_by_hash(conn, graph_hash)
    return {n.signal for n in graph.nodes.values() if n.kind == NodeKind.WAIT and n.signal}


def warn_unheard(conn: Conn, ref: RunRef, name: str) -> None:
    heard = sorted(listened(conn, ref.graph_hash))
    what = f"its waits listen for {', '.join(map(repr, heard))}" if heard else "it has no wait"
    warnings.warn(
        f"run {ref.id}: no wait node of workflow {ref.workflow!r} listens for signal {name!r} "
        f"({what}); the signal is kept, unheard",
        UnheardSignal, stacklevel=4,
    )  # fmt: skip


def unheard_signals(conn: Conn, run_id: str) -> list[tuple[str, int]]:
    """The signals a run keeps that no wait node of its graph listens for, with their counts
    (`cyclone run` names them: a mistyped name is otherwise kept forever, unseen)."""
    rows = conn.execute(QUERIES["run_pending_signals"], {"run_id": _uuid(run_id)}).fetchall()
    if not rows:
        return []
    heard = listened(conn, rows[0]["graph_hash"])
    return [(r["name"], r["n"]) for r in rows if r["name"] not in heard]

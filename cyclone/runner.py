"""Running one leased step: the part of a worker that is the same in every process.

`execute` runs user code (a handler, a map's items, a child's input) and never writes;
`record` writes the outcome, fenced by the lease; `record_effects` commits what the handler
wrote through `ctx.transaction()` in the same transaction as the outcome. The worker process
runs `execute` in its main thread while its lease keeper (worker/keeper.py) renews the lease;
the test harness calls them in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from cyclone.context import CancelEvent, Effects, StepContext
from cyclone.db import encode_json
from cyclone.engine import (
    complete_and_lease,
    complete_step,
    expand_map,
    fail_step,
    graph_by_hash,
    lease_step,
    start_child,
)
from cyclone.engine.patches import patched
from cyclone.engine.steps import DEFAULT_LEASE_TTL, Lease, child_concurrency
from cyclone.errors import CycloneError, PayloadTooLarge, PermanentError
from cyclone.frozen import quick_init
from cyclone.sql import QUERIES
from cyclone.states import ErrorKind, NodeKind
from cyclone.workflow import _UNSET, Registry

Conn = psycopg.Connection[Any]
# Enough traceback to find the line that failed, without letting one step bloat the table.
_MAX_ERROR_CHARS = 4000


@quick_init
@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    value: Any = None
    encoded: str | None = None
    error: str | None = None
    kind: ErrorKind = ErrorKind.ERROR
    retry: bool = True

    @classmethod
    def failed(
        cls, error: str, *, retry: bool = True, kind: ErrorKind = ErrorKind.ERROR
    ) -> Outcome:
        return cls(ok=False, error=error[:_MAX_ERROR_CHARS], retry=retry, kind=kind)


def load_results(conn: Conn, lease: Lease) -> dict[str, Any]:
    """Outputs of the run's complete nodes; a map's output only once every item completed."""
    rows = conn.execute(QUERIES["run_results"], {"run_id": lease.run_id}).fetchall()
    by_node: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_node.setdefault(row["node"], []).append(row)
    results: dict[str, Any] = {}
    for node, steps in by_node.items():
        if not all(s["state"] == "completed" for s in steps):
            continue
        if steps[0]["kind"] == NodeKind.MAP and steps[0]["item_index"] is not None:
            results[node] = [s["output"] for s in steps]
        else:
            results[node] = steps[0]["output"]
    return results


def make_context(
    conn: Conn,
    lease: Lease,
    done: threading.Event | None = None,
    effects: Effects | None = None,
) -> StepContext:
    return StepContext(
        run_id=lease.run_id,
        step_id=lease.step_id,
        workflow=lease.workflow,
        node=lease.node,
        attempt=lease.attempt,
        input=lease.input,
        item=lease.item,
        deadline=lease.deadline_at,
        deadline_left=lease.deadline_left,
        done=done or CancelEvent(),
        results=lambda: load_results(conn, lease),
        effects=effects,
        patched=lambda change: patched(conn, lease.run_id, lease.workflow, change),
    )


def execute(
    conn: Conn,
    registry: Registry,
    lease: Lease,
    *,
    done: threading.Event | None = None,
    effects: Effects | None = None,
) -> Outcome:
    """Run the user code behind a leased step and check what it gave back."""
    ctx = make_context(conn, lease, done, effects)
    try:
        node = registry.node(lease.workflow, lease.node)
        if lease.is_fanout:
            value = node.items(ctx) if node.items else []
            if not isinstance(value, list | tuple):
                return Outcome.failed(
                    f"map items must be a list, got {type(value).__name__}", retry=False
                )
            cap = node.spec.max_items
            if cap is not None and len(value) > cap:
                return Outcome.failed(
                    f"map {lease.node!r} gave {len(value)} items, more than its max_items "
                    f"({cap}): raise max_items on the node, or split the work",
                    retry=False,
                    kind=ErrorKind.TOO_MANY_ITEMS,
                )
        elif lease.kind == NodeKind.CHILD:
            value = _child_input(node, ctx)
            try:
                # A child under a concurrency limit needs its key: checked here, where a bad
                # input fails the node (not retried), not as the child is recorded.
                child_concurrency(conn, node.spec.child or "", value)
            except ValueError as exc:
                return Outcome.failed(f"child {node.spec.child}: {exc}", retry=False)
        else:
            value = _call(node, ctx)
    except PermanentError as exc:
        return Outcome.failed(_describe(exc), retry=False)
    except CycloneError as exc:
        return Outcome.failed(_describe(exc))
    except (Exception, asyncio.CancelledError) as exc:
        return Outcome.failed(_describe(exc))
    except SystemExit as exc:
        # sys.exit() in a handler ends the attempt, not the worker: recorded as the crash it
        # would have been, with what the handler did (KeyboardInterrupt is left to propagate:
        # in TestEnv it is the user's Ctrl-C).
        return Outcome.failed(
            f"handler raised SystemExit({_safe_repr(exc.code)})\n{_describe(exc)}",
            kind=ErrorKind.CRASHED,
        )  # fmt: skip
    what = f"value returned by {lease.workflow}/{lease.node}"
    try:
        encoded = encode_json(value, what)
    except (TypeError, PayloadTooLarge) as exc:
        # Not retried: the same code would return the same thing again.
        return Outcome.failed(str(exc), retry=False)
    except RecursionError:
        # Nested deeper than the interpreter's stack: a failure of the step, not the worker.
        return Outcome.failed(f"{what}: nested too deep to store as JSON", retry=False)
    return Outcome(ok=True, value=value, encoded=encoded)


def record(conn: Conn, lease: Lease, outcome: Outcome, *, now: datetime | None = None) -> bool:
    """Write the outcome under the lease; False when the lease was lost (result discarded)."""
    if not outcome.ok:
        return fail_step(
            conn,
            lease.step_id,
            lease.token,
            kind=outcome.kind,
            error=outcome.error or "failed",
            retry=outcome.retry,
            now=now,
        )
    if lease.is_fanout:
        return expand_map(conn, lease, list(outcome.value), now=now)
    if lease.kind == NodeKind.CHILD:
        spec = graph_by_hash(conn, lease.graph_hash).nodes[lease.node]
        child = start_child(
            conn, lease, spec.child or "", outcome.value, max_wait=spec.max_wait, now=now
        )
        return child is not None
    return complete_step(conn, lease, outcome.value, now=now, encoded=outcome.encoded)


def record_effects(
    effects: Effects, lease: Lease, outcome: Outcome, *, now: datetime | None = None
) -> bool | None:
    """Record the outcome with the attempt's fenced transaction, when a block began one.

    None: no block did, record as usual. A success commits the effects and the completion
    together, or neither when the lease was lost (False). A failure rolls the effects back and
    returns None: the failure is recorded as usual. A psycopg.Error means the commit may not
    have happened: the caller must record a failure (fenced) rather than the completion again
    without its effects.
    """
    if not effects.pending:
        return None
    if not outcome.ok:
        effects.discard()
        return None
    try:
        written = record(effects.conn, lease, outcome, now=now)  # type: ignore[arg-type]
        if written:
            effects.commit()
    finally:
        effects.discard()  # after a commit, nothing left to discard
    return written


def record_and_lease(
    conn: Conn,
    lease: Lease,
    outcome: Outcome,
    *,
    worker: str,
    workflows: Sequence[str] | None = None,
    lease_ttl: float = DEFAULT_LEASE_TTL,
    now: datetime | None = None,
    graphs: Sequence[str] | None = None,
) -> tuple[bool, Lease | None]:
    """`record`, then lease the next due step: one statement for a completed task step."""
    if outcome.ok and lease.kind == NodeKind.TASK:
        return complete_and_lease(
            conn, lease, outcome.value, worker=worker, workflows=workflows,
            lease_ttl=lease_ttl, now=now, encoded=outcome.encoded, graphs=graphs,
        )  # fmt: skip
    written = record(conn, lease, outcome, now=now)
    return written, lease_step(
        conn, worker=worker, workflows=workflows, lease_ttl=lease_ttl, now=now, graphs=graphs
    )


def _call(node: Any, ctx: StepContext) -> Any:
    if node.fn is None:
        raise PermanentError(f"node {ctx.node!r} has no handler")
    if node.is_async:
        return asyncio.run(_run_async(node.fn, ctx))
    return node.fn(ctx)


async def _run_async(fn: Any, ctx: StepContext) -> Any:
    """Run an async handler as a task that `ctx.done` cancels."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(fn(ctx))
    done = ctx.done
    if isinstance(done, CancelEvent):
        done.add_callback(lambda: _cancel_soon(loop, task))
    return await task


def _cancel_soon(loop: asyncio.AbstractEventLoop, task: asyncio.Future[Any]) -> None:
    # Set from another thread, maybe just after the handler returned and its loop closed.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(task.cancel)


def _child_input(node: Any, ctx: StepContext) -> Any:
    value = node.child_input
    if value is _UNSET:
        return ctx.input
    return value(ctx) if callable(value) else value


def _describe(exc: BaseException) -> str:
    # A handler's exception is user code: its str() may raise, and must not take the worker
    # (and the error) down with it. format_exception copes on its own.
    head = f"{type(exc).__name__}: {_safe_str(exc)}"
    try:
        tail = "".join(traceback.format_exception(exc))[-(_MAX_ERROR_CHARS // 2) :]
    except Exception as failed:  # a traceback of user objects can fail too (RecursionError)
        tail = f"(no traceback: formatting it raised {type(failed).__name__})"
    return f"{head}\n{tail}"


def _safe_str(value: object) -> str:
    try:
        return str(value)
    except Exception as exc:
        return f"<str() raised {type(exc).__name__}>"


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<repr() raised {type(exc).__name__}>"


__all__ = [
    "Outcome",
    "execute",
    "load_results",
    "make_context",
    "record",
    "record_and_lease",
    "record_effects",
]

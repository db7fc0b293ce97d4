"""`ctx.patched("change-id")`: changing a workflow's logic under running runs.

A change to what a node does (not to the graph: that is a new version, engine/versions.py)
reaches runs already under way at their next step. `ctx.patched(id)` tells the two apart: True
for runs created once code containing the change had registered, False for older ones. The
answer is recorded on the run (cyclone_runs.patches) by the first call, so a retry, another item
of a map or another VM (old code or new) reads the same one, whenever the call is made.

When the change "first registered" is kept in cyclone_patches. Registration (a supervisor's
start, TestEnv.register) finds the ids its handlers pass to `ctx.patched` as string literals
and records them with the time, keeping the first; an id a handler computes at run time is
recorded at its first call, with the time its process registered its code.
"""

from __future__ import annotations

import dis
import types
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

import psycopg

from cyclone.sql import QUERIES
from cyclone.workflow import Workflow

Conn = psycopg.Connection[Any]

# When this process registered each workflow's code (the database's clock), by name: the
# time a change found only at run time is taken to have registered.
_REGISTERED_AT: dict[str, datetime] = {}
# Longest change id: it is a key of a run's JSON and a label in docs, not a payload.
MAX_PATCH_ID = 200


def check_patch_id(patch: object) -> str:
    """The id, or one clear error naming what is wrong with it."""
    if not isinstance(patch, str):
        raise TypeError(f"ctx.patched: expected a change id (a string), got {patch!r}")
    if not patch or len(patch) > MAX_PATCH_ID or not patch.isprintable():
        raise ValueError(
            f"ctx.patched: a change id is 1 to {MAX_PATCH_ID} printable characters, got {patch!r}"
        )
    return patch


def literal_patches(fn: Callable[..., Any] | None) -> set[str]:
    """The string literals `fn` (and functions defined inside it) pass to a `.patched(...)`."""
    code = getattr(fn, "__code__", None)
    return set(_literals(code)) if isinstance(code, types.CodeType) else set()


def _literals(code: types.CodeType) -> Iterator[str]:
    pending = False
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval == "patched":
            pending = True
            continue
        if pending and ins.opname == "LOAD_CONST" and isinstance(ins.argval, str):
            yield ins.argval
        if ins.opname not in ("PUSH_NULL", "CACHE", "PRECALL"):
            pending = False
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _literals(const)


def workflow_patches(workflow: Workflow) -> list[str]:
    """The change ids a workflow's handlers name as literals, sorted."""
    found: set[str] = set()
    for node in workflow.nodes.values():
        for fn in (node.fn, node.items, node.child_input):
            if callable(fn):
                found |= literal_patches(fn)
    return sorted(p for p in found if p and len(p) <= MAX_PATCH_ID and p.isprintable())


def register_patches(
    conn: Conn, workflows: Iterable[Workflow], *, now: datetime | None = None
) -> None:
    """Inside registration's transaction: record when each workflow's code registered (in this
    process) and the changes its handlers name, keeping the first time each was seen."""
    for wf in workflows:
        row = conn.execute(
            QUERIES["patches_register"],
            {"workflow": wf.name, "patches": workflow_patches(wf), "now": now},
        ).fetchone()
        _REGISTERED_AT[wf.name] = row["registered_at"]


def patched(conn: Conn, run_id: str, workflow: str, patch: str) -> bool:
    """The run's answer for `patch`: the one recorded, else computed and recorded now."""
    params = {
        "run_id": run_id, "workflow": workflow, "patch": check_patch_id(patch),
        "registered_at": _REGISTERED_AT.get(workflow),
    }  # fmt: skip
    # A None answer: another call recorded it after this statement's snapshot; ask again.
    for _ in range(3):
        row = conn.execute(QUERIES["run_patched"], params).fetchone()
        if row is None:
            raise LookupError(f"ctx.patched: run {run_id} is gone")
        if row["patched"] is not None:
            return bool(row["patched"])
    raise RuntimeError(f"ctx.patched: no answer recorded for {patch!r} on run {run_id}")

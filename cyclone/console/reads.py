"""What the console's pages read: each function one page's data, from named statements.

Every read is bounded by a LIMIT and an index (cyclone/sql/console.sql, status.sql), so a page
costs what it shows. Filtered listings walk a window of at most `SCAN` rows in their index's
order; when a window ends before the page is full, the page says how far back it searched
and links to the next window, rather than reading the whole history for a rare match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from cyclone.schedules import ticks_after
from cyclone.sql import QUERIES
from cyclone.status import take_snapshot

Conn = psycopg.Connection[Any]

PAGE = 50  # rows a listing shows
SCAN = 20_000  # rows a filtered listing may walk for one page (see the module docstring)
STEPS_SHOWN = 200  # a run's steps on its page (a map of more says how many are not shown)
ATTEMPTS_SHOWN = 2000  # failed attempts of those steps
CHILDREN_SHOWN = 50
PAYLOAD_SHOWN = 64 * 1024  # characters of an input or output shown; the rest is counted
QUEUE_CAP = 100_000  # live runs counted per state on the limits page
NEXT_TICKS = 3


@dataclass(frozen=True, slots=True)
class RunFilter:
    """The runs page's filters, checked (see `cyclone.console.forms`)."""

    state: str | None = None
    workflow: str | None = None
    queue: str | None = None
    ckey: str | None = None
    error: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def params(self) -> dict[str, Any]:
        return {
            "state": self.state, "workflow": self.workflow, "queue": self.queue,
            "ckey": self.ckey, "error": self.error, "since": self.since, "until": self.until,
        }  # fmt: skip

    @property
    def narrows(self) -> bool:
        """Whether a filter drops rows inside the window (a time range only moves it)."""
        return any((self.state, self.workflow, self.queue, self.ckey, self.error))


@dataclass(frozen=True, slots=True)
class Page:
    """A page of a listing: its rows, the cursor of the next page (None: no more), and where
    a filtered window stopped short of a full page (None: it did not)."""

    rows: list[dict[str, Any]]
    next_cursor: tuple[Any, Any] | None
    searched_to: datetime | None = None


def _page(
    conn: Conn, query: str, boundary: str, params: dict[str, Any], key: tuple[str, str],
    narrows: bool, limit: int = PAGE, scan: int | None = None,
) -> Page:  # fmt: skip
    scan = scan or SCAN
    # One row more than shown says whether another page exists. Unprepared: the optional
    # filters leave a generic plan blind to which apply (as run_list).
    args = {**params, "limit": limit + 1, "scan": scan}
    with conn.transaction():
        conn.execute(QUERIES["console_walk"], {"local": True})
        rows = [dict(r) for r in conn.execute(QUERIES[query], args, prepare=False).fetchall()]
        if len(rows) > limit:
            rows = rows[:limit]
            return Page(rows, (rows[-1][key[0]], rows[-1][key[1]]))
        if not narrows:
            return Page(rows, None)  # the window was not full: nothing older in range
        edge = conn.execute(QUERIES[boundary], args, prepare=False).fetchone()
    if edge is None:
        return Page(rows, None)
    cursor = (edge[key[0]], edge[key[1]])
    return Page(rows, cursor, searched_to=edge[key[0]])


def runs_page(
    conn: Conn, flt: RunFilter, cursor: tuple[datetime, str] | None = None, *,
    limit: int = PAGE, scan: int | None = None,
) -> Page:  # fmt: skip
    before_at, before_id = cursor or (None, None)
    params = {**flt.params(), "before_at": before_at, "before_id": before_id}
    return _page(
        conn, "console_runs", "console_runs_boundary", params, ("created_at", "id"),
        flt.narrows, limit, scan,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DlqFilter:
    reason: str | None = None
    workflow: str | None = None
    error: str | None = None
    since: datetime | None = None

    def params(self) -> dict[str, Any]:
        return {
            "reason": self.reason, "workflow": self.workflow, "error": self.error,
            "since": self.since,
        }  # fmt: skip

    @property
    def narrows(self) -> bool:
        return any((self.workflow, self.error))  # a reason is a seek, not a filter


def dlq_page(
    conn: Conn, flt: DlqFilter, cursor: tuple[datetime, int] | None = None, *,
    limit: int = PAGE, scan: int | None = None,
) -> Page:  # fmt: skip
    before_at, before_id = cursor or (None, None)
    params = {**flt.params(), "before_at": before_at, "before_id": before_id}
    return _page(
        conn, "console_dlq", "console_dlq_boundary", params, ("completed_at", "id"),
        flt.narrows, limit, scan,
    )  # fmt: skip


def dlq_depth(conn: Conn) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.execute(QUERIES["status_dlq_depth"]).fetchall()]


# --- a run ----------------------------------------------------------------------------------


@dataclass
class RunView:
    """Everything a run's page shows."""

    run: dict[str, Any]
    steps: list[dict[str, Any]]
    steps_total: int
    summary: list[dict[str, Any]]
    attempts: dict[int, list[dict[str, Any]]]
    children: list[dict[str, Any]]
    failure: dict[str, Any] | None
    graph: Graph
    input_text: str = ""
    output_text: str = ""
    trace_id: str | None = None
    timeline: list[dict[str, Any]] = field(default_factory=list)


def run_view(conn: Conn, run_id: str) -> RunView | None:
    with conn.transaction():
        conn.execute(QUERIES["status_begin"])  # one moment for every part of the page
        conn.execute(QUERIES["console_walk"], {"local": True})
        run = conn.execute(QUERIES["console_run"], {"run_id": run_id}).fetchone()
        if run is None:
            return None
        run = dict(run)
        summary = [dict(r) for r in conn.execute(
            QUERIES["run_steps_summary"], {"run_id": run_id}).fetchall()]  # fmt: skip
        steps = [dict(r) for r in conn.execute(
            QUERIES["console_run_steps"], {"run_id": run_id, "limit": STEPS_SHOWN}
        ).fetchall()]  # fmt: skip
        attempts: dict[int, list[dict[str, Any]]] = {}
        for a in conn.execute(
            QUERIES["console_step_attempts"],
            {"step_ids": [s["id"] for s in steps], "limit": ATTEMPTS_SHOWN},
        ).fetchall():
            attempts.setdefault(a["step_id"], []).append(dict(a))
        children = [dict(r) for r in conn.execute(
            QUERIES["console_run_children"], {"run_id": run_id, "limit": CHILDREN_SHOWN}
        ).fetchall()]  # fmt: skip
    failure = run["failure"] if run["state"] == "failed" else None
    view = RunView(
        run=run,
        steps=steps,
        steps_total=sum(r["steps"] for r in summary),
        summary=summary,
        attempts=attempts,
        children=children,
        failure=failure,
        graph=graph_layout(run.get("graph") or {}, summary),
        input_text=_payload(run["input"]),
        output_text=_payload(run["output"]) if run["output"] is not None else "",
        trace_id=_trace_id(run.get("trace_parent")),
    )
    view.timeline = timeline(run, steps, attempts)
    return view


def _payload(value: Any) -> str:
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)
    if len(text) > PAYLOAD_SHOWN:
        return text[:PAYLOAD_SHOWN] + f"\n… ({len(text) - PAYLOAD_SHOWN:,} more characters)"
    return text


def _trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C traceparent (`00-<32 hex>-<16 hex>-<2 hex>`), else None."""
    if not traceparent:
        return None
    parts = traceparent.split("-")
    if len(parts) < 4 or len(parts[1]) != 32:
        return None
    trace = parts[1].lower()
    if any(c not in "0123456789abcdef" for c in trace) or trace == "0" * 32:
        return None
    return trace


# --- the graph ------------------------------------------------------------------------------

# A node's state on the graph, from its steps' states: the liveliest wins.
_NODE_ORDER = ("running", "available", "waiting", "dead", "discarded", "completed")
BOX_W, BOX_H, GAP_X, GAP_Y = 150, 40, 40, 16


@dataclass
class Graph:
    nodes: list[dict[str, Any]]
    edges: list[tuple[float, float, float, float]]
    width: int
    height: int


def graph_layout(graph: dict[str, Any], summary: list[dict[str, Any]]) -> Graph:
    """Nodes in columns by their depth (longest path from a root), with their state."""
    nodes = graph.get("nodes") or []
    after = {n["name"]: list(n.get("after") or []) for n in nodes}
    depth: dict[str, int] = {}

    def depth_of(name: str, seen: frozenset[str] = frozenset()) -> int:
        if name not in depth:
            parents = [p for p in after.get(name, []) if p in after and p not in seen]
            depth[name] = 1 + max((depth_of(p, seen | {name}) for p in parents), default=-1)
        return depth[name]

    counts: dict[str, dict[str, int]] = {}
    for row in summary:
        counts.setdefault(row["node"], {}).setdefault(row["state"], 0)
        counts[row["node"]][row["state"]] += row["steps"]
    columns: dict[int, list[str]] = {}
    for n in nodes:
        columns.setdefault(depth_of(n["name"]), []).append(n["name"])
    where: dict[str, tuple[float, float]] = {}
    placed = []
    for col, names in sorted(columns.items()):
        for row, name in enumerate(names):
            x, y = col * (BOX_W + GAP_X) + 4, row * (BOX_H + GAP_Y) + 4
            where[name] = (x, y)
            states = counts.get(name, {})
            state = next((s for s in _NODE_ORDER if s in states), "pending")
            total = sum(states.values())
            kind = next((n.get("kind") for n in nodes if n["name"] == name), "")
            placed.append({
                "name": name, "kind": kind, "state": state, "x": x, "y": y,
                "w": BOX_W, "h": BOX_H, "counts": states, "total": total,
                "done": states.get("completed", 0),
            })  # fmt: skip
    edges = []
    for name, parents in after.items():
        for p in parents:
            if p in where and name in where:
                (px, py), (cx, cy) = where[p], where[name]
                edges.append((px + BOX_W, py + BOX_H / 2, cx, cy + BOX_H / 2))
    width = (max(columns, default=0) + 1) * (BOX_W + GAP_X) + 8
    height = max((len(v) for v in columns.values()), default=1) * (BOX_H + GAP_Y) + 8
    return Graph(placed, edges, width, height)


# --- the timeline ---------------------------------------------------------------------------

TIMELINE_W = 600  # the SVG's user units across; it scales to the page


def timeline(
    run: dict[str, Any], steps: list[dict[str, Any]], attempts: dict[int, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """One row per step: a bar per attempt, placed on the run's time from submit to its end
    (or now), so retries, backoffs and kills are seen where they happened."""
    start: datetime = run["created_at"]
    end: datetime = run["finished_at"] or run["now"]
    span = max((end - start).total_seconds(), 0.001)

    def x(at: datetime | None) -> float:
        if at is None:
            return TIMELINE_W
        return max(0.0, min(TIMELINE_W, (at - start).total_seconds() / span * TIMELINE_W))

    rows = []
    for s in steps:
        bars = []
        for a in attempts.get(s["id"], []):
            left = x(a["started_at"] or a["ended_at"])
            bars.append({"x": left, "w": max(x(a["ended_at"]) - left, 2.0),
                         "outcome": a["error_kind"], "attempt": a["attempt"]})  # fmt: skip
        # The step's own latest attempt: running, or how it ended (a dead step's last attempt
        # is in the attempts already).
        if s["started_at"] is not None and s["state"] in ("running", "completed"):
            left = x(s["started_at"])
            right = x(s["completed_at"]) if s["completed_at"] else x(end)
            bars.append({"x": left, "w": max(right - left, 2.0), "outcome": s["state"],
                         "attempt": s["attempt"]})  # fmt: skip
        rows.append({"step": s, "bars": bars})
    return rows


# --- the fleet, limits, schedules -----------------------------------------------------------


def fleet(conn: Conn) -> Any:
    return take_snapshot(conn, presence_only=True)


def overview(conn: Conn) -> Any:
    return take_snapshot(conn)


def limits(conn: Conn, *, limit: int = 200) -> dict[str, list[dict[str, Any]]]:
    params = {"limit": limit}
    with conn.transaction():
        conn.execute(QUERIES["status_begin"])
        conn.execute(QUERIES["console_walk"], {"local": True})
        out = {
            name: [dict(r) for r in conn.execute(QUERIES[query], params).fetchall()]
            for name, query in (("keys", "limits_keys"), ("nodes", "limits_nodes"),
                                ("rates", "limits_rates"), ("workflows", "console_workflows"))
        }  # fmt: skip
        out["use"] = [dict(r) for r in conn.execute(
            QUERIES["console_queue_use"], {"cap": QUEUE_CAP}).fetchall()]  # fmt: skip
    return out


def queues(use: list[dict[str, Any]], workflows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Queue by queue: its workflows, and its live runs by priority and state."""
    out: dict[str, dict[str, Any]] = {}
    for w in workflows:
        q = out.setdefault(w["queue"], {"name": w["queue"], "workflows": [], "by_priority": {}})
        q["workflows"].append(w)
    for u in use:
        q = out.setdefault(u["queue"], {"name": u["queue"], "workflows": [], "by_priority": {}})
        q["by_priority"].setdefault(u["priority"], {})[u["state"]] = u["runs"]
    return [out[k] for k in sorted(out)]


def schedules(conn: Conn, *, limit: int = 500) -> list[dict[str, Any]]:
    from cyclone.engine.schedules import list_schedules

    out = []
    for s in list_schedules(conn, limit=limit):
        ticks = [s.next_tick_at]
        later = ticks_after(s.cron, s.every, s.timezone, s.next_tick_at)
        ticks += [next(later) for _ in range(NEXT_TICKS - 1)]
        out.append({"info": s, "ticks": ticks})
    return out


def clock(conn: Conn) -> datetime:
    return conn.execute(QUERIES["clock_now"]).fetchone()["now"]


def since_ago(now: datetime, seconds: float) -> datetime:
    return now - timedelta(seconds=seconds)

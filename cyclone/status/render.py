"""A Snapshot drawn with rich: the same renderable for the live screen and the one-shot print."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from cyclone.display import seconds, table, when
from cyclone.models import node_label
from cyclone.sanitize import printable
from cyclone.status.compact import render_compact
from cyclone.status.snapshot import Snapshot, for_display


def render(
    snap: Snapshot,
    *,
    problem: str | None = None,
    width: int | None = None,
    height: int | None = None,
) -> Group:
    """Everything on one screen, most urgent first: who works, then what waits or died.

    The tables when they fit `width` columns and `height` lines (None: no bound), else the
    compact layout, a line per thing, which fits 80x24.
    """
    snap, problem = for_display(snap), printable(problem) if problem else problem
    parts: list[Any] = [_header(snap)]
    if problem:
        parts.append(Text(problem, style="bold red"))
    if snap.unserved:
        parts.append(unserved_warning(snap))
    parts += [supervisors_table(snap), workers_table(snap)]
    parts += [_runs_table(snap), _dlq_table(snap)]
    parts += [_deadline_table(snap), _paused_table(snap)]
    if snap.schedules:
        parts.append(_schedules_table(snap))
    if _fits(parts, width, height):
        return Group(*parts)
    return render_compact(snap, problem=problem, width=width, height=height)


def _fits(parts: list[Any], width: int | None, height: int | None) -> bool:
    """Whether the parts fit unfolded: no table wider than `width`, `height` lines in all."""
    if height is not None and sum(_lines(p) for p in parts) > height:
        return False
    if width is None:
        return True
    from rich.measure import Measurement

    measuring = Console(file=io.StringIO(), width=100_000, markup=False)
    return all(Measurement.get(measuring, measuring.options, p).maximum <= width for p in parts)


def _lines(part: Any) -> int:
    if isinstance(part, Table):  # title, heading and its rule, a line a row (none is folded)
        return (1 if part.title else 0) + (2 if part.show_header else 0) + part.row_count
    return len(part.plain.split("\n"))


def _header(snap: Snapshot) -> Text:
    busy = sum(1 for w in snap.workers if w["state"] == "busy")
    live = sum(1 for s in snap.supervisors if not s["lost"])
    q = snap.queue
    text = Text("cyclone status", style="bold cyan")
    text.append(f"  {when(snap.taken_at)} (database clock)\n")
    if snap.replica_lag is not None:
        text.append(f"read from a replica, {seconds(snap.replica_lag)} behind the primary\n")
    text.append(
        # Two lines, so that neither is folded mid-word at 80 columns.
        f"{live} supervisor(s), {busy}/{len(snap.workers)} workers busy\n"
        f"{'more than ' if q['due_capped'] else ''}{q['due']} step(s) due, "
        f"oldest waiting {seconds(q['oldest_due_age'])}; "
        f"{q['running']} running; DLQ {snap.dlq_total}"
    )
    return text


def unserved_warning(snap: Snapshot) -> Text:
    """Runs whose graph version no live supervisor serves wait with workers idle: say so
    first, with the version they need (`cyclone workflows` lists them)."""
    named = ", ".join(
        f"{r['workflow']} version {(r.get('graph_hash') or '?')[:12]} ({r['runs']})"
        for r in snap.unserved
    )
    return Text(
        f"no worker serves: {named} running run(s); deploy code that has their nodes (a VM of"
        " that version: `cyclone workflows`), or load their module ([workflows] modules) and"
        " restart: a reload does not re-import a module",
        style="bold yellow",
    )


def _table(title: str, *columns: str) -> Table:
    return table(title, columns, wrap=("step", "run", "host"))


def supervisors_table(snap: Snapshot) -> Table:
    t = _table("Supervisors", "host", "pid", "state", "workers", "queues", "up", "last seen")
    for s in snap.supervisors:
        state = "lost" if s["lost"] else s["state"]
        mine = [w for w in snap.workers if w["supervisor_id"] == s["id"]]
        busy = sum(1 for w in mine if w["state"] == "busy")
        queues = s.get("queues")
        t.add_row(
            s["host"],
            str(s["pid"]),
            Text(state, style="red" if s["lost"] else ""),
            f"{busy} busy / {len(mine)} (target {s['workers_target']})",
            "every" if queues is None else ", ".join(queues) or "none",
            seconds(s["up_for"]),
            f"{seconds(s['seen_ago'])} ago",
        )
    if not snap.supervisors:
        t.add_row("none has published itself", "-", "-", "-", "-", "-", "-")
    return t


def workers_table(snap: Snapshot) -> Table:
    hosts = {s["id"]: f"{s['host']}:{s['pid']}" for s in snap.supervisors}
    t = _table(
        "Workers",
        "supervisor",
        "slot",
        "pid",
        "state",
        "step",
        "elapsed",
        "lease left",
        "deadline left",
    )
    for w in snap.workers:
        t.add_row(
            hosts.get(w["supervisor_id"], w["supervisor_id"]),
            str(w["slot"]),
            str(w["pid"]),
            Text(w["state"], style="green" if w["state"] == "busy" else "dim"),
            step_label(w),
            seconds(w["elapsed"]) if w["state"] == "busy" else "-",
            _left(w["lease_left"]),
            _left(w["deadline_left"]) if w["state"] == "busy" else "-",
        )
    return t


def step_label(w: dict[str, Any]) -> str:
    if w["state"] != "busy":
        return "idle"
    node = node_label(w["node"], w["item_index"])
    label = f"{w['workflow']}/{node} #{w['step_id']} attempt {w['attempt']} run={w['run_id']}"
    if w["step_state"] not in (None, "running"):
        label += f" (step now {w['step_state']})"
    return label


def _left(value: float | None) -> Text:
    if value is None:
        return Text("-")
    return Text(seconds(value), style="red" if value < 0 else ("yellow" if value < 60 else ""))


def _runs_table(snap: Snapshot) -> Table:
    window = seconds(snap.finished_window_seconds)
    t = _table("Runs", "state", "runs")
    for state, n in snap.runs_live.items():
        t.add_row(state, str(n))
    for state, n in snap.runs_finished.items():
        t.add_row(f"{state} (last {window})", str(n))
    return t


def _dlq_table(snap: Snapshot) -> Table:
    t = _table("DLQ by reason", "reason", "steps", "newest")
    for r in snap.dlq:
        t.add_row(r["reason"], str(r["steps"]), when(r["newest"]))
    if not snap.dlq:
        t.add_row("-", "0", "-")
    return t


def _none(title: str, what: str = "none") -> Text:
    """An empty section: its title and one word, not a table of dashes that reads as a row."""
    return Text.assemble((title, "bold"), f"  {what}")


def _deadline_table(snap: Snapshot) -> Table | Text:
    if not snap.deadline_failures:
        return _none("Recent deadline failures")
    t = _table("Recent deadline failures", "run", "workflow", "steps killed", "failed")
    for r in snap.deadline_failures:
        t.add_row(str(r["run_id"]), r["workflow"], str(r["steps"]), f"{seconds(r['ago'])} ago")
    return t


def _paused_table(snap: Snapshot) -> Table | Text:
    if not snap.paused:
        return _none("Paused runs")
    shown = (
        f" ({len(snap.paused)} of {snap.paused_total})"
        if snap.paused_total > len(snap.paused)
        else ""
    )
    t = _table(f"Paused runs{shown}", "run", "workflow", "paused for", "deadline left (frozen)")
    for r in snap.paused:
        frozen = "no deadline" if r["frozen_left"] is None else seconds(r["frozen_left"])
        t.add_row(str(r["id"]), r["workflow"], seconds(r["paused_for"]), frozen)
    return t


def _schedules_table(snap: Snapshot) -> Table:
    t = _table("Next schedule ticks", "schedule", "workflow", "next tick", "in", "missed")
    for r in snap.schedules:
        t.add_row(r["name"], r["workflow"], when(r["next_tick_at"]), seconds(r["due_in"]),
                  str(r["missed"]))  # fmt: skip
    return t

"""`cyclone status` for a small terminal (80x24): one line per thing, most urgent first.

The full layout's tables need about 130 columns and a line per worker plus three per section;
at 80x24 they folded a worker's step into 13 lines and pushed everything else off the screen.
Here a line is one thing, cut to the width only where what is cut is repeated elsewhere (an
ellipsis marks it); what an operator acts on is never cut: the DLQ's counts and the database
error fold onto lines of their own, and a busy worker's run id goes on the next line when it
does not fit on its worker's. The sections an operator acts on come first: the queue, the DLQ,
lost supervisors, runs failed by their deadline and paused runs. Workers fill the lines left,
busy ones first, and say how many did not fit.
"""

from __future__ import annotations

import textwrap
from typing import Any

from rich.console import Group
from rich.text import Text

from cyclone.display import seconds, when
from cyclone.models import node_label
from cyclone.sanitize import printable
from cyclone.status.snapshot import Snapshot, for_display

# Listed before the workers: at most this many lines each for lost supervisors, deadline
# failures and paused runs; the rest is counted on one line.
SECTION_ROWS = 3


def render_compact(
    snap: Snapshot,
    *,
    problem: str | None = None,
    width: int | None = None,
    height: int | None = None,
) -> Group:
    """The snapshot in at most `height` lines (all of it when `height` is None); a worker's
    run id is added to its line where it fits whole in `width`."""
    snap, problem = for_display(snap), printable(problem) if problem else problem
    lines = [_title(snap)]
    if problem:
        lines += [Text(part, style="bold red") for part in _fold(problem, width)]
    lines += [_queue(snap), _runs(snap), *_dlq(snap, width)]
    lines += _lost(snap) + _deadline_failures(snap) + _paused(snap) + _schedules(snap)
    room = None if height is None else max(height - len(lines), 2)
    lines += _workers(snap, room, width)
    for line in lines:
        line.no_wrap, line.overflow = True, "ellipsis"
    return Group(*lines)


def _title(snap: Snapshot) -> Text:
    text = Text("cyclone status", style="bold cyan")
    text.append(f"  {when(snap.taken_at)} (database clock)")
    return text


def _queue(snap: Snapshot) -> Text:
    q = snap.queue
    text = Text("queue  ", style="bold")
    text.append(
        f"{'more than ' if q['due_capped'] else ''}{q['due']} step(s) due, oldest waiting "
        f"{seconds(q['oldest_due_age'])}; {q['running']} running",
        style="yellow" if (q["oldest_due_age"] or 0) >= 60 else "",
    )
    return text


def _runs(snap: Snapshot) -> Text:
    text = Text("runs   ", style="bold")
    text.append(", ".join(f"{n} {state}" for state, n in snap.runs_live.items()))
    finished = ", ".join(f"{n} {state}" for state, n in snap.runs_finished.items())
    text.append(f"; last {seconds(snap.finished_window_seconds)}: {finished}")
    return text


def _fold(text: str, width: int | None, indent: str = "") -> list[str]:
    """`text` in lines of at most `width` (one line when None); nothing is cut."""
    if width is None:
        return [text]
    return textwrap.wrap(
        text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    ) or [""]


def _dlq(snap: Snapshot, width: int | None) -> list[Text]:
    text = Text("DLQ    ", style="bold")
    if not snap.dlq:
        return [text.append("empty")]
    reasons = ", ".join(f"{r['reason']} {r['steps']}" for r in snap.dlq)
    newest = (snap.taken_at - max(r["newest"] for r in snap.dlq)).total_seconds()
    text.append(f"{snap.dlq_total} step(s), newest {seconds(newest)} ago", style="red")
    rest = f"; {reasons}"
    if width is None or text.cell_len + len(rest) <= width:
        return [text.append(rest)]
    # The counts by reason, folded under it: every one is what `dlq list --reason` takes.
    return [text, *(Text(line) for line in _fold(f"       by reason: {reasons}", width, " " * 7))]


def _lost(snap: Snapshot) -> list[Text]:
    lost = [s for s in snap.supervisors if s["lost"]]
    lines = [
        Text.assemble(
            ("LOST   ", "bold red"),
            f"supervisor {s['host']}:{s['pid']}, last seen {seconds(s['seen_ago'])} ago",
        )
        for s in lost[:SECTION_ROWS]
    ]
    if len(lost) > SECTION_ROWS:
        lines.append(Text(f"       and {len(lost) - SECTION_ROWS} more lost supervisor(s)"))
    return lines


def _deadline_failures(snap: Snapshot) -> list[Text]:
    failures = snap.deadline_failures
    if not failures:
        return [Text.assemble(("deadline failures  ", "bold"), "none recent")]
    lines = [Text.assemble(("deadline failures", "bold"), f"  {len(failures)} recent run(s)")]
    for r in failures[:SECTION_ROWS]:
        lines.append(
            Text(
                f"  {r['run_id']}  {r['workflow']}  {r['steps']} step(s) killed "
                f"{seconds(r['ago'])} ago",
                style="red",
            )
        )
    if len(failures) > SECTION_ROWS:
        lines.append(Text("  more: cyclone dlq list --reason deadline"))
    return lines


def _paused(snap: Snapshot) -> list[Text]:
    if not snap.paused_total:
        return []
    lines = [Text.assemble(("paused", "bold"), f"  {snap.paused_total} run(s), longest first")]
    for r in snap.paused[:SECTION_ROWS]:
        frozen = "no deadline" if r["frozen_left"] is None else f"{seconds(r['frozen_left'])} left"
        lines.append(
            Text(f"  {r['id']}  {r['workflow']}  for {seconds(r['paused_for'])}, {frozen}")
        )
    if snap.paused_total > SECTION_ROWS:
        lines.append(Text("  more: cyclone runs --state paused"))
    return lines


def _schedules(snap: Snapshot) -> list[Text]:
    """One line, the soonest ticks first (the width cuts the later ones); none without
    schedules, so a deployment that has none loses no worker line to them."""
    if not snap.schedules:
        return []
    missed = sum(s["missed"] for s in snap.schedules)
    text = Text("ticks  ", style="bold")
    if missed:
        text.append(f"{missed} missed; ", style="red")
    return [text.append(", ".join(f"{s['name']} in {seconds(s['due_in'])}"
                                  for s in snap.schedules))]  # fmt: skip


def _workers(snap: Snapshot, room: int | None, width: int | None) -> list[Text]:
    """A line per live supervisor with its busy workers under it, longest busy first; idle
    workers are counted. Given `room` lines only, the busy workers that do not fit are counted
    on the last line."""
    live = [s for s in snap.supervisors if not s["lost"]]
    busy_total = sum(1 for w in snap.workers if w["state"] == "busy")
    lines = [
        Text.assemble(
            ("workers", "bold"),
            f"  {busy_total}/{len(snap.workers)} busy on {len(live)} live supervisor(s)"
            + ("" if snap.supervisors else ": none has published itself"),
        )
    ]
    kinds = ["title"]  # what each line is, to count the ones that do not fit
    for sup in live:
        mine = [w for w in snap.workers if w["supervisor_id"] == sup["id"]]
        busy = sorted((w for w in mine if w["state"] == "busy"), key=lambda w: -(w["elapsed"] or 0))
        lines.append(
            Text(
                f" {sup['host']}:{sup['pid']}  {len(busy)}/{len(mine)} busy "
                f"(target {sup['workers_target']}), {len(mine) - len(busy)} idle, "
                f"up {seconds(sup['up_for'])}"
            )
        )
        kinds.append("supervisor")
        if busy and "heading" not in kinds:
            lines.append(Text("  slot  pid      elapsed  lease  deadline  step", style="dim"))
            kinds.append("heading")
        for w in busy:
            worker = _worker(w, width)
            lines += worker
            kinds += ["worker", *["run"] * (len(worker) - 1)]
    if room is None or len(lines) <= room:
        return lines
    keep = room - 1
    while keep > 1 and kinds[keep] == "run":  # a worker's line goes with its run id's
        keep -= 1
    cut = kinds[keep:]
    counts = (("busy worker", cut.count("worker")), ("supervisor", cut.count("supervisor")))
    more = " and ".join(f"{n} more {what}(s)" for what, n in counts if n)
    return [*lines[:keep], Text(f"  and {more}: cyclone workers lists all")]


def _worker(w: dict[str, Any], width: int | None) -> list[Text]:
    text = Text(f"  {w['slot']:<4}  {w['pid']:<7}  {seconds(w['elapsed']):>7}  ")
    text.append_text(_left(w["lease_left"], 5))
    text.append("  ")
    text.append_text(_left(w["deadline_left"], 8))
    node = node_label(w["node"], w["item_index"])
    step = f"  {w['step_id']} {w['workflow']}/{node} attempt {w['attempt']}"
    if w["step_state"] not in (None, "running"):
        step += f" (step now {w['step_state']})"
    text.append(step)
    run = f"  run {w['run_id']}"
    if width is None or text.cell_len + len(run) <= width:
        return [text.append(run, style="dim")]
    return [text, Text(f"        run {w['run_id']}", style="dim")]  # whole, on a line of its own


def _left(value: float | None, width: int) -> Text:
    if value is None:
        return Text("-".rjust(width))
    style = "red" if value < 0 else ("yellow" if value < 60 else "")
    return Text(seconds(value).rjust(width), style=style)

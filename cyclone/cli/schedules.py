"""`schedules`: list, show, pause, resume, trigger, backfill and delete schedules
(docs/schedules.md). Creating one is the client's (`client.schedule`) or the code's
(`Workflow.schedule`): a schedule names a workflow, which the CLI cannot load."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from datetime import datetime
from typing import Any

from cyclone.cli.common import (
    OK,
    REFUSED,
    USAGE,
    CliError,
    Session,
    console,
    emit_json,
    limit_arg,
    message,
    note_hidden,
    reads_replica,
    text_arg,
)
from cyclone.display import Column, print_listing, records, seconds, when
from cyclone.engine.schedules import get_schedule, list_schedules
from cyclone.sanitize import printable
from cyclone.schedules import ScheduleInfo

_NEXT_SHOWN = 5  # ticks `schedules show` lists


def time_arg(value: str) -> datetime:
    """An ISO-8601 instant with its zone (2026-03-01T00:00Z, 2026-03-01T02:00+01:00)."""
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO-8601 time: {printable(value)}") from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"give the time's zone (Z or +01:00): {printable(value)}")
    return moment


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    sched = sub.add_parser("schedules", help="schedules: list, show, pause, trigger, backfill")
    ssub = sched.add_subparsers(dest="schedules_command", metavar="COMMAND", required=True)

    p = ssub.add_parser("list", parents=common, help="every schedule, its next tick and counts")
    p.add_argument("--limit", type=limit_arg, default=1000, help="at most this many")
    p.set_defaults(run=list_command)
    reads_replica(p)

    p = ssub.add_parser("show", parents=common, help="one schedule, with its next ticks")
    p.add_argument("name", type=text_arg, metavar="NAME", help="the schedule's name")
    p.set_defaults(run=show)
    reads_replica(p)

    for verb, help_text in (
        ("pause", "no tick starts a run until resumed"),
        ("resume", "tick again, from the first tick after now"),
        ("trigger", "start one run now, under the schedule's overlap policy"),
        ("delete", "delete the schedule (its runs stay)"),
    ):
        p = ssub.add_parser(verb, parents=common, help=help_text)
        p.add_argument("name", type=text_arg, metavar="NAME", help="the schedule's name")
        p.set_defaults(run=control, verb=verb)

    p = ssub.add_parser(
        "backfill", parents=common,
        help="start the runs of the ticks in a past range that have none",
        description=(
            "Start a run for each tick in [START, END) that has none yet, whatever the "
            "overlap policy. A tick already run (by the schedule or an earlier backfill) "
            "is not run again: its run's key names the tick."
        ),
    )  # fmt: skip
    p.add_argument("name", type=text_arg, metavar="NAME", help="the schedule's name")
    p.add_argument("start", type=time_arg, metavar="START", help="from this ISO time (with zone)")
    p.add_argument("end", type=time_arg, metavar="END", help="up to this ISO time, excluded")
    p.set_defaults(run=backfill)


def _state(s: ScheduleInfo) -> str:
    return "paused" if s.paused else "active"


def list_command(session: Session, args: argparse.Namespace) -> int:
    found = list_schedules(session.connect(), limit=args.limit)
    if args.json:
        emit_json(found)
        return OK
    shown = print_listing(
        console(),
        [
            Column("schedule"),
            Column("workflow"),
            Column("when"),
            Column("zone", drop=3, hide_empty=True),
            Column("state"),
            Column("next tick", drop=2),
            Column("run/skip/miss", drop=1),
        ],
        [
            (s.name, s.workflow, s.cron or f"every {seconds(s.every)}", s.cron and s.timezone,
             _state(s), None if s.paused else s.next_tick_at,
             f"{s.started}/{s.skipped}/{s.missed}")
            for s in found
        ],
    )  # fmt: skip
    if not found:
        message("no schedules")
    note_hidden(shown)
    return OK


def show(session: Session, args: argparse.Namespace) -> int:
    s = get_schedule(session.connect(), args.name)
    ticks = s.next_ticks(_NEXT_SHOWN)
    if args.json:
        emit_json({**asdict(s), "next_ticks": ticks})
        return OK
    fields = [
        ("schedule", s.name), ("workflow", s.workflow), ("when", s.when),
        ("state", _state(s)), ("overlap", s.overlap.value),
        ("catch-up", seconds(s.catchup_window)), ("jitter", seconds(s.jitter) if s.jitter else "-"),
        ("run deadline", seconds(s.run_deadline) if s.run_deadline else "-"),
        ("declared", "in code" if s.declared else "by a client"),
        ("next ticks", "\n".join(when(t) for t in ticks) or "-"),
        ("buffered", "\n".join(when(t) for t in s.buffered) or "-"),
        ("last tick", when(s.last_tick_at)), ("last run", s.last_run_id or "-"),
        ("last lag", seconds(s.last_lag)),
        ("ticks", f"{s.started} started, {s.skipped} skipped, {s.missed} missed"),
    ]  # fmt: skip
    columns = [Column(name, lines=True) for name, _ in fields]
    console().print(records(columns, [[str(v) for _, v in fields]], numbered=False),
                    soft_wrap=True)  # fmt: skip
    return OK


_PAST = {"pause": "paused", "resume": "resumed", "delete": "deleted"}


def control(session: Session, args: argparse.Namespace) -> int:
    client = session.client()
    if args.verb == "delete":
        if not client.delete_schedule(args.name):
            message(f"no schedule {args.name!r}")
            return REFUSED
    elif args.verb == "pause":
        client.pause_schedule(args.name)
    elif args.verb == "resume":
        client.resume_schedule(args.name)
    else:
        run_id = client.trigger_schedule(args.name)
        if args.json:
            emit_json({"schedule": args.name, "run_id": run_id})
        elif run_id is None:
            overlap = get_schedule(session.connect(), args.name).overlap.value
            message(f"schedule {args.name!r}: its previous run is active; overlap policy "
                    f"{overlap}: no run started")  # fmt: skip
        else:
            print(run_id, flush=True)
        return OK
    if args.json:
        emit_json({"schedule": args.name, "done": _PAST[args.verb]})
    else:
        message(f"schedule {args.name!r} {_PAST[args.verb]}")
    return OK


def backfill(session: Session, args: argparse.Namespace) -> int:
    try:
        ids = session.client().backfill_schedule(args.name, args.start, args.end)
    except ValueError as exc:
        raise CliError(USAGE, str(exc)) from None
    if args.json:
        emit_json({"schedule": args.name, "run_ids": ids})
        return OK
    for run_id in ids:
        print(run_id, flush=True)
    message(f"schedule {args.name!r}: {len(ids)} runs started")
    return OK

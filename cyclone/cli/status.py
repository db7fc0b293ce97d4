"""`status` (the live screen, or one snapshot) and `workers` (who holds what, right now)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import psycopg

from cyclone.cli.common import (
    OK,
    CliError,
    Session,
    console,
    emit_json,
    message,
    note_hidden,
    positive_duration_arg,
    reads_replica,
    redact,
)
from cyclone.display import Column, print_listing, seconds
from cyclone.models import node_label
from cyclone.status import Snapshot, take_snapshot

# Status refreshes: one slow query must not freeze the screen for long.
STATUS_STATEMENT_TIMEOUT_MS = 2000
# Polling PostgreSQL faster than once a second shows nothing new and costs every host.
MIN_INTERVAL = 0.5


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        parents=common,
        help="live view: supervisors, workers, runs, DLQ, deadlines",
        description=(
            "A live screen refreshed about once a second; Ctrl-C leaves. With --once, "
            "--json, or when stdout is not a terminal, prints one snapshot and exits."
        ),
    )
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval", type=positive_duration_arg, default=1.0, help="refresh, e.g. 2s")
    p.set_defaults(run=status, statement_timeout_ms=STATUS_STATEMENT_TIMEOUT_MS)
    reads_replica(p)

    p = sub.add_parser("workers", parents=common, help="supervisors and what their workers hold")
    p.set_defaults(run=workers, statement_timeout_ms=STATUS_STATEMENT_TIMEOUT_MS)
    reads_replica(p)


def snapshot_json(snap: Snapshot) -> dict[str, Any]:
    return {
        "version": snap.version,
        "taken_at": snap.taken_at,
        "supervisors": snap.supervisors,
        "workers": snap.workers,
        "runs": {"live": snap.runs_live, "finished_recently": snap.runs_finished},
        "finished_window_seconds": snap.finished_window_seconds,
        "queue": snap.queue,
        "dlq": {"total": snap.dlq_total, "by_reason": snap.dlq},
        "deadline_failures": snap.deadline_failures,
        "paused": {"total": snap.paused_total, "runs": snap.paused},
        "unserved": snap.unserved,
        "schedules": snap.schedules,
        "replica_lag": snap.replica_lag,
    }


def status(session: Session, args: argparse.Namespace) -> int:
    from cyclone.status.render import render

    try:
        snap = take_snapshot(session.connect())
    except KeyboardInterrupt:  # Ctrl-C leaves the status view cleanly, whenever it comes
        return OK
    if args.json:
        emit_json(snapshot_json(snap))
        return OK
    out = console()
    if args.once or not sys.stdout.isatty():
        out.print(render(snap, width=out.width))
        return OK
    return _live(session, out, snap, max(args.interval, MIN_INTERVAL))


def _live(session: Session, out: Any, snap: Snapshot, interval: float) -> int:
    from rich.live import Live

    from cyclone.status.render import render

    try:
        # One line short of the screen: a full screen would scroll the top line away.
        size = {"width": out.width, "height": out.height - 1}
        with Live(render(snap, **size), console=out, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                problem = None
                try:
                    snap = take_snapshot(session.connect())
                except CliError as exc:  # unreachable: keep the last picture, say so, retry
                    problem = exc.message
                except psycopg.errors.QueryCanceled:  # the session is fine after a timeout
                    problem = "a status query timed out; retrying"
                except psycopg.OperationalError as exc:
                    session.close()
                    problem = f"database error, retrying: {redact(session.dsn, str(exc))}"
                size = {"width": out.width, "height": out.height - 1}  # it may be resized
                live.update(render(snap, problem=problem, **size), refresh=True)
    except KeyboardInterrupt:
        return OK


def workers(session: Session, args: argparse.Namespace) -> int:
    snap = take_snapshot(session.connect(), presence_only=True)
    if args.json:
        emit_json(
            {"taken_at": snap.taken_at, "supervisors": snap.supervisors, "workers": snap.workers}
        )
        return OK
    out = console()
    hosts = {s["id"]: f"{s['host']}:{s['pid']}" for s in snap.supervisors}
    shown = [
        print_listing(
            out,
            [
                Column("supervisor"),
                Column("state"),
                Column("workers"),
                Column("queues", drop=3),
                Column("up", drop=2),
                Column("last seen", drop=1),
            ],
            [
                (
                    hosts[s["id"]],
                    "lost" if s["lost"] else s["state"],
                    f"{sum(w['supervisor_id'] == s['id'] for w in snap.workers)} "
                    f"(target {s['workers_target']})",
                    "every" if s.get("queues") is None else ", ".join(s["queues"]) or "none",
                    seconds(s["up_for"]),
                    f"{seconds(s['seen_ago'])} ago",
                )
                for s in snap.supervisors
            ],
        )
    ]
    if not snap.supervisors:
        message("no supervisor has published itself")
        return OK
    out.print()
    shown.append(
        print_listing(
            out,
            [
                Column("supervisor"),
                Column("slot"),
                Column("pid"),
                Column("state"),
                Column("step", hide_empty=True),
                Column("run", hide_empty=True),
                Column("workflow/node", hide_empty=True),
                Column("attempt", hide_empty=True),
                Column("elapsed", drop=3),
                Column("lease left", drop=2),
                Column("deadline left", drop=1),
            ],
            [
                (
                    hosts.get(w["supervisor_id"], w["supervisor_id"]),
                    w["slot"],
                    w["pid"],
                    w["state"],
                    w["step_id"],
                    w["run_id"],
                    None
                    if w["node"] is None
                    else f"{w['workflow']}/{node_label(w['node'], w['item_index'])}",
                    w["attempt"],
                    seconds(w["elapsed"]) if w["state"] == "busy" else None,
                    seconds(w["lease_left"]) if w["lease_left"] is not None else None,
                    seconds(w["deadline_left"]) if w["state"] == "busy" else None,
                )
                for w in snap.workers
            ],
        )
    )
    for listing in shown:
        note_hidden(listing)
    return OK

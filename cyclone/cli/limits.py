"""`limits`: the flow-control limits in force and their use right now (docs/flow-control.md).

Runs per key (a workflow's `Concurrency`), steps per node (`concurrency=N`) and rate limiters
(`set_rate_limit`), each with what holds a slot or waits for one. Read-only: the role of
`cyclone status` is enough.
"""

from __future__ import annotations

import argparse
from typing import Any

from cyclone.cli.common import (
    OK,
    Session,
    console,
    emit_json,
    limit_arg,
    note_hidden,
    reads_replica,
)
from cyclone.display import Column, print_listing
from cyclone.sql import QUERIES


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "limits", parents=common,
        help="concurrency and rate limits in force, and their use now",
    )  # fmt: skip
    p.add_argument("--limit", type=limit_arg, default=50, help="most rows per table (default 50)")
    p.set_defaults(run=limits)
    reads_replica(p)


def limits(session: Session, args: argparse.Namespace) -> int:
    conn = session.connect()
    params = {"limit": args.limit}
    keys = [dict(r) for r in conn.execute(QUERIES["limits_keys"], params).fetchall()]
    nodes = [dict(r) for r in conn.execute(QUERIES["limits_nodes"], params).fetchall()]
    rates = [dict(r) for r in conn.execute(QUERIES["limits_rates"], params).fetchall()]
    if args.json:
        emit_json({"keys": keys, "nodes": nodes, "rates": rates})
        return OK
    out = console()
    shown = []
    out.print("Runs per key")
    shown.append(print_listing(
        out,
        [Column("workflow"), Column("key"), Column("limit"), Column("active"), Column("queued")],
        [(k["workflow"], k["key"], k["limit"], k["active"], k["queued"]) for k in keys]
        or [("(none)", None, None, None, None)],
    ))  # fmt: skip
    out.print()
    out.print("Steps per node")
    shown.append(print_listing(
        out,
        [Column("workflow/node"), Column("limit"), Column("in use"), Column("held")],
        [(f"{n['workflow']}/{n['node']}", n["limit"], n["in_use"], n["held"]) for n in nodes]
        or [("(none)", None, None, None)],
    ))  # fmt: skip
    out.print()
    out.print("Rate limits")
    shown.append(print_listing(
        out,
        [Column("limiter"), Column("rate"), Column("burst"), Column("bucket"),
         Column("tokens"), Column("held")],
        [(r["name"], f"{r['rate']:g} per {r['per']:g}s", f"{r['burst']:g}",
          "(one)" if r["key"] == "" else r["key"],
          None if r["tokens"] is None else f"{r['tokens']:.1f}", r["held"]) for r in rates]
        or [("(none)", None, None, None, None, None)],
    ))  # fmt: skip
    for listing in shown:
        note_hidden(listing)
    return OK

"""`workflows`: each workflow's graph versions, their live runs and the VMs serving each
(docs/deploys.md). Read-only: the role of `cyclone status` is enough.
"""

from __future__ import annotations

import argparse
from typing import Any

from cyclone.cli.common import OK, Session, console, emit_json, limit_arg, note_hidden
from cyclone.display import Column, print_listing
from cyclone.sql import QUERIES

# A supervisor seen this recently serves (as `cyclone status` calls one lost after it).
LOST_AFTER = 10.0
# A version's hash as a listing shows it (--json has it whole).
SHORT = 12


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "workflows", parents=common,
        help="each workflow's graph versions: live runs, the VMs serving each, first/last seen",
    )  # fmt: skip
    p.add_argument("--workflow", metavar="NAME", help="only this workflow's versions")
    p.add_argument("--limit", type=limit_arg, default=200, help="most versions (default 200)")
    p.set_defaults(run=workflows)


def workflows(session: Session, args: argparse.Namespace) -> int:
    conn = session.connect()
    params = {"workflow": args.workflow, "limit": args.limit, "lost_after": LOST_AFTER}
    rows = [dict(r) for r in conn.execute(QUERIES["workflow_versions"], params).fetchall()]
    if args.json:
        emit_json({"versions": rows})
        return OK
    out = console()
    shown = print_listing(
        out,
        [Column("workflow"), Column("version"), Column("current"), Column("live runs"),
         Column("served by"), Column("first seen", drop=2), Column("last served", drop=1)],
        [(r["workflow"], r["graph_hash"][:SHORT], "yes" if r["current"] else None,
          r["live_runs"], ", ".join(r["served_by"]) or ("NONE" if r["live_runs"] else None),
          r["first_seen"], "now" if r["served_by"] else r["last_served"]) for r in rows]
        or [("(none)", None, None, None, None, None, None)],
    )  # fmt: skip
    note_hidden(shown)
    return OK

"""Schema administration: `migrate`."""

from __future__ import annotations

import argparse
from typing import Any

from cyclone.cli.common import OK, Session, emit_json, message
from cyclone.migrate import latest_version, migrate


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "migrate", parents=common, help="apply pending schema migrations (under a lock)"
    )
    # DDL may wait on the migration lock or on a long transaction: no statement timeout.
    # It sets the database up: the one command that may create and start the embedded server.
    p.set_defaults(run=run_migrate, statement_timeout_ms=0, start_embedded=True)


def run_migrate(session: Session, args: argparse.Namespace) -> int:
    applied = migrate(session.connect())
    version = latest_version()
    if args.json:
        emit_json({"applied": applied, "version": version})
    elif applied:
        message(f"applied migration(s) {', '.join(map(str, applied))}; schema at version {version}")
    else:
        message(f"schema is up to date (version {version})")
    return OK

"""Schema administration: `migrate`, and the GRANTs of a least-privilege deployment."""

from __future__ import annotations

import argparse
from typing import Any

from psycopg import sql

from cyclone.cli.common import OK, REFUSED, USAGE, CliError, Session, emit_json, message, role_arg
from cyclone.migrate import MigrationLocked, latest_version, migrate
from cyclone.sql import QUERIES

# The roles' default names in the printed GRANTs.
ROLES = {
    "migrator": "cyclone_migrator",
    "runtime": "cyclone_runtime",
    "readonly": "cyclone_readonly",
}


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "migrate", parents=common, help="apply pending schema migrations (under a lock)"
    )
    p.add_argument(
        "--print-grants", action="store_true",
        help="print the GRANTs for a migrating, a runtime and a read-only role (changes nothing)",
    )  # fmt: skip
    for key, default in ROLES.items():
        p.add_argument(
            f"--{key}", default=default, metavar="ROLE", type=role_arg, help=f"default: {default}"
        )
    # DDL may wait on the migration lock or on a long transaction: no statement timeout.
    # It sets the database up: the one command that may create and start the embedded server.
    p.set_defaults(run=run_migrate, statement_timeout_ms=0, start_embedded=True)


def run_migrate(session: Session, args: argparse.Namespace) -> int:
    if args.print_grants:
        print(grants(session, args), end="")
        return OK
    try:
        applied = migrate(session.connect())
    except MigrationLocked as exc:
        raise CliError(REFUSED, str(exc)) from None
    version = latest_version()
    if args.json:
        emit_json({"applied": applied, "version": version})
    elif applied:
        message(f"applied migration(s) {', '.join(map(str, applied))}; schema at version {version}")
    else:
        message(f"schema is up to date (version {version})")
    return OK


def grants(session: Session, args: argparse.Namespace) -> str:
    """The GRANTs for the schema this DSN's sessions use (its search_path's first)."""
    conn = session.connect()
    schema = conn.execute(QUERIES["schema_current"]).fetchone()["schema"]
    if any(ch < " " or ch == "\x7f" for ch in schema):
        # In the comment line below, a line break would begin a statement.
        raise CliError(USAGE, f"schema {schema!r}: a control character in its name")
    names = {key: sql.Identifier(getattr(args, key)) for key in ROLES}
    body = sql.SQL(QUERIES["grants_print"]).format(schema=sql.Identifier(schema), **names)
    # Quoted as in the statements: what the comment names is exactly what they grant to.
    shown_schema = sql.Identifier(schema).as_string(conn)
    head = (
        f"-- Cyclone's roles on schema {shown_schema}: run as its owner or a superuser, after\n"
        f"-- `cyclone migrate` ran as {names['migrator'].as_string(conn)}; again after an "
        "upgrade adds tables.\n"
    )
    return head + body.as_string(conn).split("\n", 1)[1] + "\n"

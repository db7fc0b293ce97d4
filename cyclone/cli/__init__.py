"""`cyclone`: the operator's command line (docs/cli.md, made from these parsers).

    cyclone [--config FILE | --dsn URL] COMMAND [--json] ...

Exit status: 0 done, 1 not found or refused, 2 usage or configuration, 3 database unreachable,
124 `run --wait --timeout` ran out with the run still going.
No command prints a traceback or a password. `main(argv)` returns the status, so tests run the
CLI in-process; the `cyclone` console script exits with it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import psycopg
from psycopg import errors as pg_errors

from cyclone.cli import admin, console, dlq, embedded, limits, runs, schedules, status, versions
from cyclone.cli.common import (
    REFUSED,
    STATEMENT_TIMEOUT_MS,
    UNREACHABLE,
    USAGE,
    CliError,
    Session,
    message,
    redact,
)
from cyclone.db import unreachable
from cyclone.engine.dlq import RetryRefused
from cyclone.errors import (
    ConfigError,
    RunNotFound,
    ScheduleNotFound,
    StepNotFound,
    WorkflowNotFound,
)
from cyclone.version import package_version

_NOT_FOUND = (RunNotFound, StepNotFound, WorkflowNotFound, ScheduleNotFound, RetryRefused)


def build_parser() -> argparse.ArgumentParser:
    # The database options are accepted before or after the command (`cyclone --dsn X runs`
    # and `cyclone runs --dsn X`); SUPPRESS keeps a subcommand from resetting the top level's.
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("database")
    where.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="a TOML config")
    where.add_argument(
        "--dsn", metavar="URL", default=argparse.SUPPRESS,
        help="a PostgreSQL URL; other users see it in ps: prefer CYCLONE_DATABASE_URL",
    )  # fmt: skip
    listing = argparse.ArgumentParser(add_help=False)
    listing.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON"
    )
    parser = argparse.ArgumentParser(
        prog="cyclone",
        description="Operate Cyclone: runs, steps, the DLQ, workers and the live status view.",
        epilog="Exit status: 0 done, 1 not found or refused, 2 usage or config, "
        "3 database unreachable, 124 run --wait --timeout ran out. The database is --dsn, "
        "else the config's database.url, else CYCLONE_DATABASE_URL, else the embedded server.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"cyclone {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (admin, runs, dlq, status, limits, schedules, versions, console, embedded):
        module.add_commands(sub, [common, listing])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else USAGE
    given = vars(args)
    if given.get("config") is not None and given.get("dsn") is not None:
        message("cyclone: --config and --dsn are alternatives: give one")
        return USAGE
    args.json = given.get("json", False)
    session = Session(
        given.get("dsn"),
        given.get("config"),
        given.get("statement_timeout_ms", STATEMENT_TIMEOUT_MS),
        start_embedded=given.get("start_embedded", False),
        # Commands that only read may go to a replica; `run --wait` listens, which a standby
        # cannot.
        read_dsn=given.get("read_dsn"),
        reads=bool(given.get("reads")) and not given.get("wait"),
    )
    try:
        return args.run(session, args)
    except CliError as exc:
        message(f"cyclone: {exc.message}")
        return exc.code
    except _NOT_FOUND as exc:
        message(f"cyclone: {exc}")
        return REFUSED
    except ConfigError as exc:
        message(f"cyclone: {exc}")
        return USAGE
    except psycopg.Error as exc:
        return _database_error(session, exc)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`cyclone dlq list | head`): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:
        if os.environ.get("CYCLONE_DEBUG"):
            raise
        text = redact(session.dsn, str(exc)) if session.dsn_known else str(exc)
        message(
            f"cyclone: internal error: {type(exc).__name__}: {text} (CYCLONE_DEBUG=1 shows more)"
        )
        return REFUSED
    finally:
        session.close()


def _database_error(session: Session, exc: psycopg.Error) -> int:
    text = redact(session.dsn, str(exc)) if session.dsn_known else str(exc)
    if isinstance(exc, pg_errors.QueryCanceled):
        message(f"cyclone: the database took too long: {text}")
        return REFUSED
    if isinstance(exc, pg_errors.UndefinedTable):
        message(
            f"cyclone: no Cyclone tables in this database or schema ({text}): run `cyclone migrate`"
        )
        return USAGE
    if unreachable(exc):
        message(f"cyclone: lost the database connection: {text}")
        return UNREACHABLE
    message(f"cyclone: database error: {text}")
    return REFUSED

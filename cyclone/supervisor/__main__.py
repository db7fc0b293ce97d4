"""`cyclone-supervisor --config FILE`: validate, connect, migrate, register, then supervise."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from cyclone.config import Settings, load_config
from cyclone.db import connect, resolve_dsn, use_prepared_statements
from cyclone.engine import register_workflows
from cyclone.errors import ConfigError, CycloneError
from cyclone.migrate import latest_version, migrate
from cyclone.sql import QUERIES
from cyclone.supervisor.supervisor import Supervisor
from cyclone.workflow import Registry, load_modules

log = logging.getLogger("cyclone.supervisor")

EXIT_USAGE = 2
EXIT_DATABASE = 3


class JsonFormatter(logging.Formatter):
    """One JSON object a line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        if hasattr(record, "action"):
            data["action"] = record.action
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data)


def setup_logging(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.logging.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.logging.level.upper())


def load_workflows(settings: Settings) -> Registry:
    return load_modules(settings.workflows.modules)


def import_workflows(settings: Settings, config_path: str | None) -> Registry:
    """Import the workflow modules, before the database is touched: a module that cannot be
    imported is the most common first-start mistake, and it must not cost a PostgreSQL start
    and a migration to find out. The config file's directory is searched last, after
    PYTHONPATH and the installed packages, so a module beside the config imports as is."""
    if config_path is not None:
        here = os.path.dirname(os.path.abspath(config_path))
        if here not in sys.path:
            sys.path.append(here)
    for name in settings.workflows.modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise ConfigError(_not_found(name, exc, config_path)) from None
        except Exception as exc:
            where = _where(exc)
            raise ConfigError(
                f'[workflows] modules: importing "{name}" failed: '
                f"{type(exc).__name__}: {exc}{where}"
            ) from None
    return load_workflows(settings)


def _not_found(name: str, exc: ModuleNotFoundError, config_path: str | None) -> str:
    missing = exc.name or name
    if name != missing and not name.startswith(missing + "."):
        return (
            f'[workflows] modules: "{name}" imports "{missing}", which is not installed: '
            "pip install it into this Python's environment"
        )
    looked = "PYTHONPATH and the installed packages"
    if config_path is not None:
        looked += f" and {os.path.dirname(os.path.abspath(config_path))}"
    return (
        f'[workflows] modules: cannot import "{name}" (searched {looked}): '
        "pip install the package that provides it, or set PYTHONPATH to the directory that "
        "holds it"
    )


def _where(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}, line {exc.lineno})"
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    return f" ({tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno})"


def prepare(settings: Settings, registry: Registry) -> str:
    """What can fail before the first fork once the code imports: database, schema, graphs.
    A new embedded cluster is logged as a warning: a second database where an operator
    expected their first one must not pass unnoticed."""
    # Before any connection: the children forked later inherit it (a reload does not change it).
    use_prepared_statements(settings.database.prepared_statements)
    dsn = resolve_dsn(settings.database.url, settings.database.embedded_dir, announce=log.warning)
    if settings.database.migrate:
        migrate(dsn)
    with connect(dsn) as conn:
        check_schema(conn)
        register_workflows(conn, registry.values())
    log.info("workflows: %s", ", ".join(sorted(registry)) or "none", extra={"action": "register"})
    return dsn


def check_schema(conn: psycopg.Connection[Any]) -> None:
    """Refuse a database whose schema this version of Cyclone does not match."""
    try:
        rows = conn.execute(QUERIES["migration_applied"]).fetchall()
    except psycopg.errors.UndefinedTable:
        rows = []
    have = max((row["version"] for row in rows), default=0)
    if have != latest_version():
        raise CycloneError(
            f"the database schema is at version {have}, this Cyclone needs {latest_version()}:"
            " run `cyclone migrate`, or set [database] migrate = true"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cyclone-supervisor", description="Run Cyclone workers and a scanner on this host."
    )
    parser.add_argument("--config", metavar="FILE", help="TOML config (default: built-in)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_config(args.config)
    except CycloneError as exc:
        print(f"cyclone-supervisor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(settings)
    try:
        registry = import_workflows(settings, args.config)
        dsn = prepare(settings, registry)
    except CycloneError as exc:
        print(f"cyclone-supervisor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except psycopg.OperationalError as exc:
        # libpq's messages name the host, never the password.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"cyclone-supervisor: database unreachable: {first}", file=sys.stderr)
        return EXIT_DATABASE
    return Supervisor(
        settings, dsn=dsn, registry=registry, config_path=args.config,
        load_workflows=load_workflows,
    ).run()  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

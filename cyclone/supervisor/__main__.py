"""`cyclone-supervisor --config FILE`: validate, connect, migrate, register, then supervise."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from cyclone.config import ENV_DATABASE_URL, Settings, load_config
from cyclone.db import check_dsn, connect, resolve_dsn, unreachable, use_prepared_statements
from cyclone.engine import register_workflows
from cyclone.errors import ConfigError, CycloneError
from cyclone.logs import JsonFormatter
from cyclone.migrate import latest_version, migrate
from cyclone.redact import redact_error
from cyclone.sanitize import SafeRecords, printable
from cyclone.sql import QUERIES
from cyclone.supervisor.supervisor import Supervisor
from cyclone.version import package_version
from cyclone.workflow import Registry, load_modules

log = logging.getLogger("cyclone.supervisor")

EXIT_USAGE = 2
EXIT_DATABASE = 3
# SQLSTATEs that a restart may not meet again: a transaction rolled back (class 40: a
# serialization failure, a deadlock), a statement or lock timeout.
TRANSIENT = ("40", "57014", "55P03")


def setup_logging(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.logging.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s")
        )
    # Every line the supervisor, its children and the handlers they run log: one line each,
    # control characters escaped, the database password removed (a handler's log included).
    handler.addFilter(SafeRecords(settings.database.url))
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
    dsn = resolve_dsn(
        settings.database.url, settings.database.embedded_dir, announce=log.warning,
        reused=log.info,
    )  # fmt: skip
    if settings.database.migrate:
        migrate(dsn)
    with connect(dsn) as conn:
        check_schema(conn)
        register_workflows(conn, registry.values())
    log.info("workflows: %s", ", ".join(sorted(registry)) or "none", extra={"action": "register"})
    if not settings.workflows.modules:
        log.warning(
            "[workflows] modules is empty: this supervisor imports no workflow, so its workers "
            "lease nothing; list your modules, e.g. modules = [\"myapp.workflows\"]",
            extra={"action": "register"},
        )  # fmt: skip
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
    parser.add_argument(
        "--version", action="version", version=f"cyclone-supervisor {package_version()}"
    )
    return parser


def check_url(settings: Settings, config_path: str | None) -> None:
    """A URL libpq would misread fails here, in one line without the password, rather than
    in a traceback at the first connection (and again at every restart systemd makes)."""
    url = settings.database.url
    if url is None:
        return
    try:
        check_dsn(url)
    except ConfigError as exc:
        origin = ENV_DATABASE_URL if os.environ.get(ENV_DATABASE_URL) else config_path
        raise ConfigError(f"{origin}: [database] url: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_config(args.config)
        check_url(settings, args.config)
    except CycloneError as exc:
        print(f"cyclone-supervisor: {printable(exc)}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(settings)
    try:
        return supervise(settings, args.config)
    except CycloneError as exc:
        print(f"cyclone-supervisor: {printable(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except psycopg.Error as exc:
        return database_error(exc, settings.database.url)


def supervise(settings: Settings, config_path: str | None) -> int:
    registry = import_workflows(settings, config_path)
    dsn = prepare(settings, registry)
    return Supervisor(
        settings, dsn=dsn, registry=registry, config_path=config_path,
        load_workflows=load_workflows,
    ).run()  # fmt: skip


def database_error(exc: psycopg.Error, url: str | None) -> int:
    """One line, never a traceback or the password, and an exit status systemd acts on: an
    unreachable database may come back (3: restarted), a refusal will not (2: not restarted,
    RestartPreventExitStatus=2): the role's rights, a read-only server, a missing object."""
    text = printable(redact_error(str(exc), url)) or type(exc).__name__
    if unreachable(exc):
        print(f"cyclone-supervisor: database unreachable: {text}", file=sys.stderr)
        return EXIT_DATABASE
    if (exc.sqlstate or "").startswith(TRANSIENT):
        print(f"cyclone-supervisor: database busy: {text}", file=sys.stderr)
        return EXIT_DATABASE
    print(f"cyclone-supervisor: database refused: {type(exc).__name__}: {text}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

"""`console`: the web console (docs/console.md), served with uvicorn on loopback by default."""

from __future__ import annotations

import argparse
from typing import Any

from cyclone.cli.common import OK, USAGE, CliError, Session, message
from cyclone.config import ConsoleConfig, load_config
from cyclone.redact import redact_dsn

EXTRA_MISSING = (
    "the web console needs its extra: pip install 'cyclone[console]' (Starlette, uvicorn, Jinja2)"
)


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "console",
        parents=common[:1],
        help="serve the web console: runs, the DLQ, limits, schedules, the fleet",
        description=(
            "Serve the web console on --bind:--port (default [console] bind and port: "
            "127.0.0.1:8465). Read-only unless [console] token (or CYCLONE_CONSOLE_TOKEN) is "
            "set; with a token, an operator who signs in with it may retry DLQ steps and "
            "cancel runs. Pages read in read-only transactions: the read-only role is enough "
            "to browse. Needs the cyclone[console] extra."
        ),
    )
    p.add_argument("--bind", metavar="ADDRESS", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, help="port to listen on (default 8465; 0 picks one)")
    p.set_defaults(run=console, statement_timeout_ms=0)


def _port(value: str) -> int:
    if not value.isascii() or not value.isdigit() or not 0 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535: {value[:20]!r}")
    return int(value)


def settings_for(session: Session, args: argparse.Namespace) -> tuple[Any, ConsoleConfig]:
    # The config's [console] section where a config is given, else the defaults (with
    # CYCLONE_CONSOLE_TOKEN read either way).
    loaded = load_config(session.config)
    return loaded, loaded.console


def read_dsn_of(settings: Any) -> str | None:
    """Where pages read: `[database] read_url` (a replica) once the config has that key
    (SPEC section 7, "later"); until then, the primary. The one place to wire it."""
    return getattr(settings.database, "read_url", None)


def console(session: Session, args: argparse.Namespace) -> int:
    try:
        # The extra's parts by name: cyclone.console may be imported already, by a caller that
        # had them, while uvicorn is the one a server needs.
        import jinja2  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        from cyclone.console import ConsoleSettings, create_app
        from cyclone.console.server import make_server
    except ImportError:
        raise CliError(USAGE, EXTRA_MISSING) from None
    loaded, conf = settings_for(session, args)
    bind = args.bind or conf.bind
    port = conf.port if args.port is None else args.port
    dsn = session.dsn
    session.connect()  # reachable, before a server that could only show errors starts
    app = create_app(ConsoleSettings(
        dsn=dsn, token=conf.token, bind=bind, trace_url=conf.trace_url,
        read_dsn=read_dsn_of(loaded),
    ))  # fmt: skip
    mode = "actions need the token" if conf.token else "read-only (no [console] token)"
    message(f"console on http://{_host(bind)}:{port}/ for {redact_dsn(dsn)}; {mode}")
    make_server(app, bind, port).run()
    return OK


def _host(bind: str) -> str:
    return f"[{bind}]" if ":" in bind else bind

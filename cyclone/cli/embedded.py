"""`embedded status|start|stop`: the embedded PostgreSQL, which keeps running between commands.

Which server: `--dir DIR`, else `--tests` (this install's test server), else the one every
command uses (CYCLONE_EMBEDDED_DIR, else the config's `[database] embedded_dir`, else the
per-user place). None of these connects through `--dsn`: they act on the server's files.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cyclone import embedded
from cyclone.cli.common import OK, REFUSED, Session, emit_json, message

WHERE = (
    "Its data directory: --dir, else CYCLONE_EMBEDDED_DIR, else the config's [database] "
    "embedded_dir, else $XDG_DATA_HOME/cyclone/pgdata (~/.local/share/cyclone/pgdata when "
    "XDG_DATA_HOME is unset)."
)


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    top = sub.add_parser(
        "embedded",
        help="the embedded PostgreSQL: status, start, stop",
        description=(
            "The embedded PostgreSQL (used when no database URL is set) keeps running after the "
            f"command that started it. {WHERE}"
        ),
    )
    esub = top.add_subparsers(dest="embedded_command", metavar="COMMAND", required=True)
    for name, run, text in (
        ("status", status, "where it is, whether it runs, and from which binaries"),
        ("start", start, "create (first time) and start it; prints its postgresql:// URL"),
        ("stop", stop, "stop it (a fast shutdown: open sessions end)"),
    ):
        p = esub.add_parser(
            name, parents=common, help=text, description=f"{text[0].upper()}{text[1:]}. {WHERE}"
        )
        which = p.add_mutually_exclusive_group()
        which.add_argument("--dir", metavar="DIR", help="the data directory to act on")
        which.add_argument(
            "--tests", action="store_true", help="this install's test server instead"
        )
        p.set_defaults(run=run)


def _target(session: Session, args: argparse.Namespace) -> Path:
    if args.dir:
        return Path(args.dir).expanduser().absolute()
    if args.tests:
        return embedded.default_test_data_dir()
    return session.embedded_dir()


def describe(path: Path) -> dict[str, Any]:
    state = embedded.inspect(path)
    if state.running:
        condition = "running"
    elif state.initialized:
        condition = "stopped"
    else:
        condition = "not created"
    ours = str(embedded._binaries() / "postgres")
    return {
        "data_dir": str(path),
        "state": condition,
        "pid": state.pid,
        "version": state.cluster_version,
        "executable": state.executable,
        "this_install": None if state.executable is None else state.executable == ours,
        "problem": (state.foreign() or embedded.probe(state.dsn)) if state.dsn else None,
        "url": None if state.dsn is None else embedded.as_url(state.dsn),
    }


def status(session: Session, args: argparse.Namespace) -> int:
    info = describe(_target(session, args))
    if args.json:
        emit_json(info)
        return OK if info["state"] == "running" else REFUSED
    lines = [f"embedded PostgreSQL in {info['data_dir']}: {info['state']}"]
    if info["state"] == "running":
        lines.append(f"  pid {info['pid']}, PostgreSQL {info['version']}, url {info['url']}")
        if info["executable"]:
            whose = "this install's" if info["this_install"] else "NOT this install's"
            lines.append(f"  runs {info['executable']} ({whose})")
        if info["problem"]:
            lines.append(f"  cannot be used: {info['problem']}")
        lines.append("  stop it: cyclone embedded stop" + _dir_flag(session, args))
    elif info["state"] == "stopped":
        lines.append("  start it: cyclone embedded start" + _dir_flag(session, args))
    else:
        lines.append("  created by: cyclone embedded start, cyclone migrate or cyclone-supervisor")
    print("\n".join(lines))
    return OK if info["state"] == "running" else REFUSED


def start(session: Session, args: argparse.Namespace) -> int:
    path = _target(session, args)
    dsn = embedded.ensure_test_server(path) if args.tests else embedded.ensure_server(path)
    url = embedded.as_url(dsn)
    if args.json:
        emit_json({"data_dir": str(path), "url": url})
    else:
        print(url)
    return OK


def stop(session: Session, args: argparse.Namespace) -> int:
    path = _target(session, args)
    pid = embedded.inspect(path).pid
    stopped = embedded.stop_server(path)
    if args.json:
        emit_json({"data_dir": str(path), "stopped": stopped, "pid": pid})
    elif stopped:
        message(f"stopped the embedded PostgreSQL in {path} (pid {pid})")
    else:
        message(f"no embedded PostgreSQL runs in {path}: nothing to stop")
    return OK


def _dir_flag(session: Session, args: argparse.Namespace) -> str:
    """The option that names this server again in a suggested command."""
    if args.dir:
        return f" --dir {args.dir}"
    if args.tests:
        return " --tests"
    return f" --config {session.config}" if session.config else ""

"""Runs: `submit`, `runs`, `run`, `steps`, `cancel`, `pause`, `resume`, `signal`."""

from __future__ import annotations

import argparse
from typing import Any

from cyclone.cli.common import (
    MAX_LIMIT,
    OK,
    REFUSED,
    USAGE,
    CliError,
    Session,
    console,
    duration_arg,
    emit_json,
    json_arg,
    limit_arg,
    message,
    run_id_arg,
    text_arg,
    to_jsonable,
)
from cyclone.client import Client
from cyclone.display import cell, seconds, table, when
from cyclone.errors import PayloadTooLarge
from cyclone.models import RunStatus
from cyclone.sql import QUERIES
from cyclone.states import RunState

_NO_INPUT: Any = object()


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("submit", parents=common, help="start a run of a registered workflow")
    p.add_argument("workflow", type=text_arg, help="the workflow's registered name")
    p.add_argument("--input", type=json_arg, default=_NO_INPUT, help="the run's input, as JSON")
    p.add_argument("--deadline", type=duration_arg, help="run deadline, e.g. 30m (0: none)")
    p.add_argument("--key", type=text_arg, help="idempotency key: a repeat returns the first run")
    p.set_defaults(run=submit)

    p = sub.add_parser("runs", parents=common, help="list runs, newest first")
    p.add_argument("--state", choices=[s.value for s in RunState])
    p.add_argument("--workflow", type=text_arg)
    p.add_argument(
        "--limit", type=limit_arg, default=50, help=f"at most this many (max {MAX_LIMIT})"
    )
    p.set_defaults(run=list_runs)

    p = sub.add_parser("run", parents=common, help="one run's state, error and output")
    p.add_argument("run_id", type=run_id_arg, metavar="RUN_ID")
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait for the run to end; exit 0 if it completed, 1 if it failed or was cancelled",
    )
    p.add_argument(
        "--timeout", type=duration_arg, help="with --wait: give up after this long, e.g. 30s"
    )
    p.set_defaults(run=show_run)

    p = sub.add_parser("steps", parents=common, help="every step of a run, error text and all")
    p.add_argument("run_id", type=run_id_arg, metavar="RUN_ID")
    p.set_defaults(run=show_steps)

    for verb, help_text in (
        ("cancel", "cancel a run and its child runs; its handlers are killed"),
        ("pause", "stop leasing a run's steps; its deadline stops too"),
        ("resume", "resume a paused run, with the time it had left"),
    ):
        p = sub.add_parser(verb, parents=common, help=help_text)
        p.add_argument("run_id", type=run_id_arg, metavar="RUN_ID")
        p.set_defaults(run=control, verb=verb)

    p = sub.add_parser("signal", parents=common, help="send a signal to a run's wait")
    p.add_argument("run_id", type=run_id_arg, metavar="RUN_ID")
    p.add_argument("name", type=text_arg, metavar="NAME")
    p.add_argument("--payload", type=json_arg, default=None, help="the signal's payload, as JSON")
    p.set_defaults(run=signal)


def submit(session: Session, args: argparse.Namespace) -> int:
    inp = None if args.input is _NO_INPUT else args.input
    try:
        run_id = session.client().submit(
            args.workflow, inp, run_deadline=args.deadline, key=args.key
        )
    except (TypeError, ValueError, PayloadTooLarge) as exc:
        raise CliError(USAGE, str(exc)) from None
    if args.json:
        emit_json({"run_id": run_id})
    else:
        print(run_id, flush=True)
    return OK


def list_runs(session: Session, args: argparse.Namespace) -> int:
    rows = (
        session.connect()
        .execute(
            QUERIES["run_list"],
            {"state": args.state, "workflow": args.workflow, "limit": args.limit},
        )
        .fetchall()
    )
    if args.json:
        emit_json(rows)
        return OK
    console().print(
        table(
            None,
            ["run", "workflow", "state", "error", "created", "deadline left", "finished"],
            (
                (
                    r["id"],
                    r["workflow"],
                    r["state"],
                    r["error_kind"],
                    r["created_at"],
                    seconds(r["deadline_left"]),
                    r["finished_at"],
                )
                for r in rows
            ),
        )
    )
    if not rows:
        message("no runs match")
    return OK


def show_run(session: Session, args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.wait:
        raise CliError(USAGE, "--timeout needs --wait")
    client = session.client()
    if args.wait:
        st = _wait(client, args.run_id, args.timeout)
        if st is None:
            return REFUSED
    else:
        st = client.get_run(args.run_id)
    status = OK if not args.wait or st.state == RunState.COMPLETED else REFUSED
    if args.json:
        emit_json(st)
        return status
    fields = to_jsonable(st)
    rows = [
        (name, when(getattr(st, name)) if name.endswith("_at") else _short(fields[name]))
        for name in fields
    ]
    console().print(table(None, ["field", "value"], rows))
    return status


def _wait(client: Client, run_id: str, timeout: float | None) -> RunStatus | None:
    try:
        return client.wait(run_id, timeout)
    except TimeoutError:
        state = client.get_run(run_id).state
        message(f"run {run_id} is still {state.value} after {seconds(timeout)}")
        return None
    finally:
        client.close()  # its listener, before the command's connection is used again


def show_steps(session: Session, args: argparse.Namespace) -> int:
    steps = session.client().steps(args.run_id)
    if args.json:
        emit_json(steps)
        return OK
    console().print(
        table(
            None,
            [
                "id",
                "node",
                "kind",
                "state",
                "attempt",
                "kind of error",
                "error",
                "started",
                "ended",
            ],
            (
                (
                    s.id,
                    s.label,
                    s.kind,
                    s.state,
                    s.attempt,
                    s.error_kind,
                    s.error,
                    s.started_at,
                    s.completed_at,
                )
                for s in steps
            ),
        )
    )
    return OK


def control(session: Session, args: argparse.Namespace) -> int:
    client = session.client()
    changed = getattr(client, args.verb)(args.run_id)
    if args.json:
        emit_json({"run_id": args.run_id, "changed": changed})
    if changed:
        message(f"run {args.run_id}: {_PAST[args.verb]}")
        return OK
    state = client.get_run(args.run_id).state
    message(f"run {args.run_id} is {state.value}: nothing to {args.verb}")
    return REFUSED


_PAST = {"cancel": "cancelled", "pause": "paused", "resume": "resumed"}


def signal(session: Session, args: argparse.Namespace) -> int:
    client = session.client()
    try:
        sent = client.signal(args.run_id, args.name, args.payload)
    except (TypeError, ValueError, PayloadTooLarge) as exc:
        raise CliError(USAGE, str(exc)) from None
    if args.json:
        emit_json({"run_id": args.run_id, "signal": args.name, "sent": sent})
    if not sent:
        state = client.get_run(args.run_id).state
        message(f"run {args.run_id} is {state.value}: signal {args.name!r} not sent")
        return REFUSED
    message(f"run {args.run_id}: signal {args.name!r} sent")
    return OK


def _short(value: Any) -> str:
    import json

    if isinstance(value, dict | list):
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 2000 else text[:1997] + "..."
    return cell(value)

"""Runs: `submit`, `runs`, `run`, `steps`, `cancel`, `pause`, `resume`, `signal`."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from cyclone.cli.common import (
    MAX_LIMIT,
    OK,
    REFUSED,
    TIMED_OUT,
    USAGE,
    CliError,
    Session,
    console,
    duration_arg,
    emit_json,
    json_arg,
    limit_arg,
    message,
    note_hidden,
    priority_arg,
    reads_replica,
    run_id_arg,
    text_arg,
    to_jsonable,
    workflow_known,
)
from cyclone.clients.client import Client
from cyclone.display import Column, cell, print_listing, records, seconds, when
from cyclone.engine.control import unheard_signals
from cyclone.errors import PayloadTooLarge, RunNotFound, UnheardSignal
from cyclone.models import RunStatus, node_label
from cyclone.sanitize import printable, printable_lines
from cyclone.sql import QUERIES
from cyclone.states import RunState, StepState

_NO_INPUT: Any = object()


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("submit", parents=common, help="start a run of a registered workflow")
    p.add_argument(
        "workflow", type=text_arg, metavar="WORKFLOW", help="the workflow's registered name"
    )
    p.add_argument(
        "--input",
        type=json_arg,
        default=_NO_INPUT,
        metavar="JSON",
        help="the run's input: JSON, @FILE for a file's, - for stdin's",
    )
    p.add_argument("--deadline", type=duration_arg, help="run deadline, e.g. 30m (0: none)")
    p.add_argument("--key", type=text_arg, help="idempotency key: a repeat returns the first run")
    p.add_argument(
        "--priority", type=priority_arg, help="1 (leased first) to 5; default: the workflow's"
    )
    p.set_defaults(run=submit)

    p = sub.add_parser("runs", parents=common, help="list runs, newest first")
    p.add_argument(
        "--state", choices=[s.value for s in RunState], metavar="STATE",
        help=f"only runs in this state: {', '.join(s.value for s in RunState)}",
    )  # fmt: skip
    p.add_argument("--workflow", type=text_arg, help="only runs of this workflow")
    p.add_argument(
        "--limit", type=limit_arg, default=50, help=f"at most this many (max {MAX_LIMIT})"
    )
    p.set_defaults(run=list_runs)
    reads_replica(p)

    p = sub.add_parser("run", parents=common, help="one run's state, error and output")
    p.add_argument("run_id", type=run_id_arg, metavar="RUN_ID", help="the run's id (a UUID)")
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait for the run to end; exit 0 if it completed, 1 if it failed or was cancelled",
    )
    p.add_argument(
        "--timeout", type=duration_arg,
        help="with --wait: give up after this long, e.g. 30s; exit 124 if it is still going",
    )  # fmt: skip
    p.set_defaults(run=show_run)
    reads_replica(p)  # not with --wait: LISTEN needs the primary

    p = sub.add_parser(
        "steps",
        parents=common,
        help="a run's steps, error text and all (counts by node for a big run)",
        description=(
            f"A run's steps in creation order, error text and all. A run of more than "
            f"{SUMMARY_OVER} steps shows counts by node and state instead, unless --state or "
            f"--limit asks for steps; the text listing stops at {STEPS_SHOWN} unless --limit "
            "says otherwise. --json lists every step that matches."
        ),
    )
    p.add_argument("run_id", type=run_id_arg, metavar="RUN_ID", help="the run's id (a UUID)")
    p.add_argument(
        "--state", choices=[s.value for s in StepState], metavar="STATE",
        help=f"only steps in this state: {', '.join(s.value for s in StepState)}",
    )  # fmt: skip
    p.add_argument("--limit", type=limit_arg, help=f"at most this many (max {MAX_LIMIT})")
    p.add_argument("--summary", action="store_true", help="counts by node and state, any size")
    p.set_defaults(run=show_steps)
    reads_replica(p)

    for verb, help_text in (
        ("cancel", "cancel a run and its child runs; its handlers are killed"),
        ("pause", "stop leasing a run's steps; its deadline stops too"),
        ("resume", "resume a paused run, with the time it had left"),
    ):
        p = sub.add_parser(verb, parents=common, help=help_text)
        p.add_argument("run_id", type=run_id_arg, metavar="RUN_ID", help="the run's id (a UUID)")
        p.set_defaults(run=control, verb=verb)

    p = sub.add_parser("signal", parents=common, help="send a signal to a run's wait")
    p.add_argument("run_id", type=run_id_arg, metavar="RUN_ID", help="the run's id (a UUID)")
    p.add_argument("name", type=text_arg, metavar="NAME", help="the signal's name")
    p.add_argument(
        "--payload",
        type=json_arg,
        default=None,
        metavar="JSON",
        help="the signal's payload: JSON, @FILE for a file's, - for stdin's",
    )
    p.set_defaults(run=signal)


def submit(session: Session, args: argparse.Namespace) -> int:
    inp = None if args.input is _NO_INPUT else args.input
    try:
        run_id = session.client().submit(
            args.workflow, inp, run_deadline=args.deadline, key=args.key, priority=args.priority
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
            prepare=False,
        )
        .fetchall()
    )
    if args.json:
        emit_json(rows)
        return OK
    shown = print_listing(
        console(),
        [
            Column("run"),
            Column("workflow"),
            Column("state"),
            Column("error"),
            Column("created", drop=2),
            Column("deadline left", drop=1),
            Column("finished", drop=3),
        ],
        [
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
        ],
    )
    if not rows:
        if args.workflow is not None and not workflow_known(session, args.workflow):
            return REFUSED
        message("no runs match")
    note_hidden(shown)
    return OK


def show_run(session: Session, args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.wait:
        raise CliError(USAGE, "--timeout needs --wait")
    client = session.client()
    if args.wait:
        st = _wait(client, args.run_id, args.timeout)
        if st is None:
            return TIMED_OUT
    else:
        st = client.get_run(args.run_id)
    status = OK if not args.wait or st.state == RunState.COMPLETED else REFUSED
    if args.json:
        emit_json(st)
        return status
    fields = to_jsonable(st)
    # One record, field per line: a long input or error must not squeeze the field names.
    console().print(
        records(
            [Column(name, lines=name == "error") for name in fields],
            [[when(getattr(st, n)) if n.endswith("_at") else _short(v) for n, v in fields.items()]],
            numbered=False,
        ),
        soft_wrap=True,
    )
    for name, count in unheard_signals(session.connect(), args.run_id):
        times = f" ({count} times)" if count > 1 else ""
        message(
            f"signal {name!r} was sent{times} but no wait node of {st.workflow} listens for it: "
            "kept, unheard (a mistyped name?)"
        )
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


# A run with more steps than this shows counts by node and state unless steps are asked for;
# a text listing stops at STEPS_SHOWN unless --limit says otherwise.
SUMMARY_OVER = 100
STEPS_SHOWN = 1000


def show_steps(session: Session, args: argparse.Namespace) -> int:
    conn = session.connect()
    counts = conn.execute(QUERIES["run_steps_summary"], {"run_id": args.run_id}).fetchall()
    if not counts and not conn.execute(QUERIES["run_exists"], {"run_id": args.run_id}).fetchone():
        raise RunNotFound(f"no run {args.run_id!r}")
    total = sum(r["steps"] for r in counts)
    asked = args.json or args.state or args.limit
    if args.summary or not (asked or total <= SUMMARY_OVER):
        return _steps_summary(args, counts, total)
    limit = args.limit or (None if args.json else STEPS_SHOWN)
    rows = conn.execute(
        QUERIES["run_steps_page"], {"run_id": args.run_id, "state": args.state, "limit": limit}
    ).fetchall()
    if args.json:
        emit_json(rows)
        return OK
    out = console()
    shown = print_listing(
        out,
        [
            Column("step"),
            Column("node"),
            Column("kind", drop=1),
            Column("state"),
            Column("attempt"),
            Column("reason", hide_empty=True),
            Column("error", first_line=True, hide_empty=True),
            Column("child run", hide_empty=True),
            Column("started", drop=3),
            Column("ended", drop=2),
        ],
        [
            (
                r["id"],
                node_label(r["node"], r["item_index"]),
                r["kind"],
                r["state"],
                r["attempt"],
                r["error_kind"],
                r["error"],
                r["child_run_id"],
                r["started_at"],
                r["completed_at"],
            )
            for r in rows
        ],
    )
    if shown.layout == "table":
        _error_details(out, rows)
    matching = sum(r["steps"] for r in counts if args.state in (None, r["state"]))
    if len(rows) < matching:
        message(f"the first {len(rows)} of {matching} steps (--limit N shows up to {MAX_LIMIT})")
    elif not rows:
        message(f"run {args.run_id} has no {args.state or ''} steps".replace("  ", " "))
    note_hidden(shown)
    return OK


def _error_details(out: Any, rows: list[dict[str, Any]]) -> None:
    """A table shows each error's first line; the rest (a traceback) follows it, whole."""
    from rich.text import Text

    for r in rows:
        error = (r["error"] or "").strip()
        if "\n" not in error:
            continue
        label = node_label(r["node"], r["item_index"])
        heading = f"step {r['id']} {label} ({r['state']}, attempt {r['attempt']}):"
        text = Text("\n" + printable(heading) + "\n", "bold")
        text.append(printable_lines(error))
        out.print(text, soft_wrap=True)


def _steps_summary(args: argparse.Namespace, counts: list[dict[str, Any]], total: int) -> int:
    if args.json:
        emit_json([{k: r[k] for k in ("node", "kind", "state", "steps")} for r in counts])
        return OK
    nodes: dict[str, dict[str, Any]] = {}
    for r in counts:
        node = nodes.setdefault(r["node"], {"kind": r["kind"], "steps": 0})
        node[r["state"]] = r["steps"]
        node["steps"] += r["steps"]
    states = [s.value for s in StepState if any(r["state"] == s.value for r in counts)]
    shown = print_listing(
        console(),
        [Column("node"), Column("kind"), Column("steps"), *(Column(s) for s in states)],
        [
            (name, n["kind"], n["steps"], *(n.get(s, "") for s in states))
            for name, n in nodes.items()
        ],
    )
    message(f"{total} steps, counted by node and state; --state S or --limit N lists them")
    note_hidden(shown)
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
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", UnheardSignal)
            sent = client.signal(args.run_id, args.name, args.payload)
    except (TypeError, ValueError, PayloadTooLarge) as exc:
        raise CliError(USAGE, str(exc)) from None
    for warning in said:
        message(f"warning: {warning.message}")
    if args.json:
        emit_json({"run_id": args.run_id, "signal": args.name, "sent": sent})
    if not sent:
        state = client.get_run(args.run_id).state
        message(f"run {args.run_id} is {state.value}: signal {args.name!r} not sent")
        return REFUSED
    message(f"run {args.run_id}: signal {args.name!r} sent")
    return OK


# An input or output longer than this is cut in `cyclone run`'s text (never in --json).
_SHOWN_JSON = 2000


def _short(value: Any) -> str:
    import json

    if isinstance(value, dict | list):
        text = json.dumps(value, ensure_ascii=False)
        if len(text) <= _SHOWN_JSON:
            return text
        return f"{text[:_SHOWN_JSON]}... ({len(text)} characters: --json shows them all)"
    return cell(value)

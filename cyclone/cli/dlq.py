"""The dead-letter queue: `dlq list` and `dlq retry`."""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

from cyclone.cli.common import (
    MAX_LIMIT,
    OK,
    REFUSED,
    Session,
    console,
    duration_arg,
    emit_json,
    limit_arg,
    message,
    note_hidden,
    positive_duration_arg,
    reads_replica,
    step_id_arg,
    text_arg,
    workflow_known,
)
from cyclone.display import Column, print_listing, when
from cyclone.engine.dlq import retry_dead_step
from cyclone.models import ExhaustedQuery
from cyclone.sanitize import printable
from cyclone.states import DEAD_KINDS


def add_commands(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    dlq = sub.add_parser("dlq", help="dead-lettered steps: list them, retry them")
    dsub = dlq.add_subparsers(dest="dlq_command", metavar="COMMAND", required=True)

    p = dsub.add_parser("list", parents=common, help="dead steps, newest first")
    p.add_argument(
        "--reason", choices=[k.value for k in DEAD_KINDS], metavar="REASON",
        help=f"the dead steps' error kind: {', '.join(k.value for k in DEAD_KINDS)}",
    )  # fmt: skip
    p.add_argument("--workflow", type=text_arg, help="only steps of this workflow")
    p.add_argument("--since", type=duration_arg, help="dead within this long, e.g. 1h")
    p.add_argument(
        "--limit", type=limit_arg, default=1000, help=f"at most this many (max {MAX_LIMIT})"
    )
    p.set_defaults(run=list_dead)
    reads_replica(p)

    p = dsub.add_parser(
        "retry",
        parents=common,
        help="re-drive a dead step: its run runs again",
        description=(
            "Re-drive a dead step: its failed run goes back to running, its dead and "
            "discarded steps come back with their attempts reset, and the nodes after them "
            "get steps as their dependencies complete. A run failed by its deadline needs "
            "--deadline, its new deadline from now."
        ),
    )
    p.add_argument("step_id", type=step_id_arg, metavar="STEP_ID", help="the step's id")
    p.add_argument("--deadline", type=positive_duration_arg, help="new run deadline, e.g. 30m")
    p.set_defaults(run=retry)

    p = dsub.add_parser(
        "attempts",
        parents=common,
        help="every failed attempt of a step, oldest first (dead or not)",
        description=(
            "Every failed, killed or dead-lettered attempt of a step, oldest first, with its "
            "whole error: the step row keeps only the latest error, and a retry clears it."
        ),
    )
    p.add_argument("step_id", type=step_id_arg, metavar="STEP_ID", help="the step's id")
    p.set_defaults(run=attempts)
    reads_replica(p)


def list_dead(session: Session, args: argparse.Namespace) -> int:
    since = None if args.since is None else timedelta(seconds=args.since)
    query = ExhaustedQuery(
        reason=args.reason, workflow=args.workflow, since=since, limit=args.limit
    )
    steps = session.client().exhausted(query)
    if args.json:
        emit_json(steps)
        return OK
    shown = print_listing(
        console(),
        [
            Column("step"),
            Column("run"),
            Column("workflow"),
            Column("node"),
            Column("reason"),
            Column("attempt"),
            Column("error", first_line=True),
            Column("dead since", drop=1),
        ],
        [
            (s.id, s.run_id, s.workflow, s.label, s.error_kind, s.attempt, s.error, s.completed_at)
            for s in steps
        ],
    )
    if not steps:
        if args.workflow is not None and not workflow_known(session, args.workflow):
            return REFUSED
        message("the DLQ has no steps that match")
    note_hidden(shown)
    return OK


def retry(session: Session, args: argparse.Namespace) -> int:
    conn = session.connect()
    done = retry_dead_step(conn, args.step_id, deadline=args.deadline)
    if args.json:
        emit_json(done)
        return OK
    print(done.run_id, flush=True)
    steps = ", ".join(str(s) for s in done.step_ids)
    deadline = f"; deadline {when(done.deadline_at)}" if done.deadline_at else ""
    message(f"run {done.run_id} ({done.workflow}) is running again: steps {steps}{deadline}")
    return OK


def attempts(session: Session, args: argparse.Namespace) -> int:
    client = session.client()
    step = client.step(args.step_id)
    history = client.attempts(step.id)
    if args.json:
        emit_json(history)
        return OK
    # One record per attempt, the error on its own lines: never cut, at any width.
    # Names, workers and errors are data: their control characters are escaped (printable).
    print(printable(f"step {step.id} ({step.workflow}/{step.label}) {step.state}, "
                    f"attempt {step.attempt}"))  # fmt: skip
    for a in history:
        worker = f"  on {a.worker}" if a.worker else ""
        print(printable(f"attempt {a.attempt}  {a.error_kind}  {when(a.ended_at)}{worker}"))
        for line in (a.error or "").splitlines() or [""]:
            print(f"    {printable(line)}")
    if not history:
        message(f"step {step.id} has no failed attempt")
    return OK

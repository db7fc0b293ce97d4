"""Workflows of the operator-trust process tests (issue 11), beside proc_flows."""

from __future__ import annotations

import time
from datetime import timedelta

import cyclone

# Many short steps: a revocation check often falls between a step's record and its report.
fanout = cyclone.Workflow("trust-fanout")


@fanout.map(items=lambda ctx: list(range(ctx.input["n"])))
def item(ctx: cyclone.StepContext) -> int:
    time.sleep(ctx.input.get("sleep", 0.002))
    return int(ctx.item)


# Steps whose timeout is always close: while they run back to back, some kill is always
# less than a publish's margin away.
short = cyclone.Workflow("trust-short")


@short.task(timeout=timedelta(milliseconds=700))
def brief(ctx: cyclone.StepContext) -> None:
    time.sleep(ctx.input.get("sleep", 0.05))

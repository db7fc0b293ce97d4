"""Workflows the console's browser tests run on a real supervisor (tests/process)."""

from __future__ import annotations

import os
from datetime import timedelta

import cyclone

pay = cyclone.Workflow("console-pay")


@pay.task(max_attempts=1)
def charge(ctx):
    # Declined until the test makes the run's flag file: then a retry goes through.
    if not os.path.exists(ctx.input["flag"]):
        raise RuntimeError(f"card declined: insufficient funds (ref {ctx.input['ref']})")
    return {"charged": ctx.input["ref"]}


@pay.task(after=[charge])
def receipt(ctx):
    return {"sent": True}


hold = cyclone.Workflow("console-hold")
hold.wait("approval", signal="approved")


nap = cyclone.Workflow("console-nap")


@nap.task(timeout=timedelta(seconds=60))
def doze(ctx):
    # Busy for a while (a worker's row shows it), or until the step is cancelled.
    ctx.done.wait(ctx.input.get("secs", 20))
    return None


# Flow control for the queues page: one run of an account at a time (the others queue).
keyed = cyclone.Workflow(
    "console-keyed", queue="emails", priority=2,
    concurrency=cyclone.Concurrency(key="account", limit=1),
)  # fmt: skip
keyed.wait("confirm", signal="confirmed")

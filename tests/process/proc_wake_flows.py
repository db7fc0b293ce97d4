"""Workflows of the wake tests (test_process_wake.py): one for each way a step becomes ready,
and one for each timer."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import cyclone


def _echo(ctx: cyclone.StepContext) -> object:
    return ctx.input


one = cyclone.Workflow("wake-one")
one.task(_echo, name="t")

join = cyclone.Workflow("wake-join")
join.task(_echo, name="a")
join.task(_echo, name="b")
join.task(_echo, name="j", after=["a", "b"])

signalled = cyclone.Workflow("wake-signal")
signalled.wait("go")
signalled.task(_echo, name="after", after=["go"])

parent = cyclone.Workflow("wake-parent")
parent.child("c", one)
parent.task(_echo, name="after", after=["c"])


def _unless_marked(ctx: cyclone.StepContext) -> str:
    if not Path(ctx.input["marker"]).exists():
        raise RuntimeError("no marker yet")
    return "ok"


dead_once = cyclone.Workflow("wake-dead-once")
dead_once.task(_unless_marked, name="f", max_attempts=1)


def _fail_first(ctx: cyclone.StepContext) -> str:
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails")
    return "ok"


retried = cyclone.Workflow("wake-retry")
retried.task(_fail_first, name="t", max_attempts=2)

slept = cyclone.Workflow("wake-sleep")
slept.sleep("s", timedelta(seconds=1))
slept.task(_echo, name="after", after=["s"])

unanswered = cyclone.Workflow("wake-max-wait")
unanswered.wait("never", max_wait=timedelta(seconds=1))


def _hang(ctx: cyclone.StepContext) -> None:
    while not ctx.done.is_set():
        time.sleep(0.05)


hung = cyclone.Workflow("wake-deadline")
hung.task(_hang, name="hang", timeout=timedelta(minutes=5), max_attempts=1)

# A token every half second, none saved up: each next step waits for the bucket's refill.
rated = cyclone.Workflow("wake-rated")
rated.task(_echo, name="t", rate_limit="wake-rated")

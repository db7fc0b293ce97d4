"""What a handler does to its own attempt stays that attempt's: sys.exit(), an exception whose
str() raises, an output nested deeper than the interpreter's stack (issue 22, item 7). Each is
recorded with what the handler did, by the same `runner.execute` a worker runs; none escapes
into the worker (which would crash it and lose the error)."""

from __future__ import annotations

import sys

import cyclone
from cyclone.states import ErrorKind, RunState, StepState
from cyclone.testing import TestEnv

misdeeds = cyclone.Workflow("handler-misdeeds")


class Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("str() of this exception raises")


def deep(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


@misdeeds.task(max_attempts=2)
def leave(ctx: cyclone.StepContext) -> str:
    if ctx.input.get("exit") is not None and ctx.attempt == 1:
        sys.exit(ctx.input["exit"])
    if ctx.input.get("unprintable") and ctx.attempt == 1:
        raise Unprintable()
    if ctx.input.get("deep"):
        return deep(5000)
    return "second attempt"


@misdeeds.map(max_attempts=1, items=lambda ctx: [deep(5000)] if ctx.input.get("deep_items") else [])
def each(ctx: cyclone.StepContext) -> int:
    return 1


def only_step(env: TestEnv, run_id: str, node: str = "leave"):
    return next(s for s in env.client.steps(run_id) if s.node == node)


def test_sys_exit_in_a_handler_is_a_crashed_attempt_that_says_so(env: TestEnv) -> None:
    env.register(misdeeds)
    run_id = env.client.submit(misdeeds, {"exit": 2})
    assert env.run_until_complete(run_id).state == RunState.COMPLETED  # retried
    (first,) = env.client.attempts(only_step(env, run_id).id)
    assert first.error_kind == ErrorKind.CRASHED
    assert (first.error or "").startswith("handler raised SystemExit(2)\n")


def test_an_exception_whose_str_raises_is_recorded_not_lost(env: TestEnv) -> None:
    env.register(misdeeds)
    run_id = env.client.submit(misdeeds, {"unprintable": True})
    assert env.run_until_complete(run_id).state == RunState.COMPLETED
    (first,) = env.client.attempts(only_step(env, run_id).id)
    assert first.error_kind == ErrorKind.ERROR
    assert (first.error or "").startswith("Unprintable: <str() raised ValueError>\n")
    assert "raise Unprintable()" in (first.error or "")  # its traceback is kept too


def test_an_output_nested_5000_deep_dead_letters_its_step(env: TestEnv) -> None:
    env.register(misdeeds)
    run_id = env.client.submit(misdeeds, {"deep": True})
    st = env.run_until_complete(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.ERROR)
    step = only_step(env, run_id)
    assert step.state == StepState.DEAD and step.attempt == 1  # the same code, the same value
    # The depth bound of every payload (issue 22, item 3) names the limit.
    assert "nested more than 100 levels deep (the limit is 100)" in (step.error or "")


def test_map_items_nested_5000_deep_dead_letter_the_map(env: TestEnv) -> None:
    env.register(misdeeds)
    run_id = env.client.submit(misdeeds, {"deep_items": True})
    st = env.run_until_complete(run_id)
    assert st.state == RunState.FAILED
    error = only_step(env, run_id, "each").error or ""
    assert "nested more than 100 levels deep (the limit is 100)" in error

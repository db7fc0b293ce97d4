"""Payloads nested deeper than MAX_JSON_DEPTH are refused where they enter (issue 22, item 3):
an input ~990 deep crash-looped the supervisor, whose json decoder recurses."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

import cyclone
from cyclone import PayloadTooDeep, PayloadTooLarge
from cyclone.db import MAX_JSON_DEPTH, encode_json
from cyclone.engine.dispatch import Dispatched
from cyclone.states import ErrorKind, RunState, StepState
from cyclone.testing import TestEnv


def nested(levels: int, leaf: Any = 0) -> Any:
    """`levels` arrays, one inside the other, around `leaf`."""
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def counts(env: TestEnv) -> tuple[int, int, int]:
    row = env.conn.execute(
        "SELECT (SELECT count(*) FROM cyclone_runs) AS r, (SELECT count(*) FROM cyclone_steps)"
        " AS s, (SELECT count(*) FROM cyclone_signals) AS g"
    ).fetchone()
    return row["r"], row["s"], row["g"]


waits = cyclone.Workflow("json-depth-waits")
waits.wait("w", signal="go")

deep_output = cyclone.Workflow("json-depth-output")


@deep_output.task(max_attempts=3)
def returns_deep(ctx: cyclone.StepContext) -> Any:
    return {"a": nested(MAX_JSON_DEPTH)}  # the object is one level more


deep_items = cyclone.Workflow("json-depth-items")


@deep_items.map(items=lambda ctx: [1, nested(MAX_JSON_DEPTH)], max_attempts=3)
def each(ctx: cyclone.StepContext) -> Any:
    return ctx.item


def test_an_input_nested_past_the_limit_is_refused_naming_it_and_writes_nothing(env: TestEnv):
    env.register(waits)
    before = counts(env)
    for deep in (nested(MAX_JSON_DEPTH + 1), nested(990), {"k": nested(100_000)}):
        with pytest.raises(PayloadTooDeep, match=rf"^input: .* \(the limit is {MAX_JSON_DEPTH}\)$"):
            env.client.submit(waits, deep)
        with pytest.raises(PayloadTooDeep):
            env.client.submit_many(waits, [{}, deep])
    assert counts(env) == before
    assert issubclass(PayloadTooDeep, PayloadTooLarge)  # caught where a too-large one is
    # At the limit, it is kept as given.
    run_id = env.client.submit(waits, nested(MAX_JSON_DEPTH))
    assert env.client.get_run(run_id).input == nested(MAX_JSON_DEPTH)


def test_a_signal_payload_nested_past_the_limit_is_refused_and_writes_nothing(env: TestEnv):
    run_id = env.client.submit(waits, {})
    before = counts(env)
    with pytest.raises(PayloadTooDeep, match="payload of signal 'go'"):
        env.client.signal(run_id, "go", nested(MAX_JSON_DEPTH + 1))
    assert counts(env) == before


@pytest.mark.parametrize("wf", [deep_output, deep_items], ids=["output", "map items"])
def test_a_handler_output_or_map_items_past_the_limit_dead_letter_the_step_at_once(
    env: TestEnv, wf: cyclone.Workflow
):
    run_id = env.client.submit(wf, {})
    status = env.run_until_complete(run_id)
    assert (status.state, status.error_kind) == (RunState.FAILED, ErrorKind.ERROR)
    (step,) = [s for s in env.client.steps(run_id) if s.state == StepState.DEAD]
    assert step.attempt == 1, "the same code returns the same thing again: not retried"
    assert f"more than {MAX_JSON_DEPTH} levels deep" in (step.error or "")


def test_the_check_does_not_recurse_however_deep_and_still_names_the_first_bad_part():
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # a check that recursed would fail at once
    try:
        with pytest.raises(PayloadTooDeep):
            encode_json(nested(1_000_000), "input")
        assert encode_json(nested(MAX_JSON_DEPTH), "input") == "[" * 100 + "0" + "]" * 100
        with pytest.raises(TypeError, match=r"input\['a'\]\[1\]\['b'\]: set is not JSON"):
            encode_json({"a": [0, {"b": {1}}]}, "input")
    finally:
        sys.setrecursionlimit(limit)


def test_an_answer_too_deep_to_decode_is_read_flat_without_the_deep_rows_lease():
    deep = "[" * 5000 + "]" * 5000
    text = (
        '{"completed":[7],"leases":[{"worker":1,"id":1,"input":' + deep + "},"
        '{"worker":2,"id":2,"input":' + json.dumps(nested(MAX_JSON_DEPTH - 2)) + "}]}"
    )
    with pytest.raises(RecursionError):
        Dispatched.parse(text)
    found = Dispatched.parse_flat(text)
    assert found.completed == {7}
    assert list(found.leases) == [1] and found.leases[1]["id"] == 2  # worker 2's, kept

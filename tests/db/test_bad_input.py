"""Bad input gets a clear, documented error and writes nothing (docs/api.md, docs/cli.md)."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cyclone
from cyclone import PayloadTooLarge, RunNotFound, WorkflowNotFound
from cyclone.db import MAX_PAYLOAD_BYTES, connect, encode_json, text_array
from cyclone.states import ErrorKind, RunState, StepState
from cyclone.testing import TestEnv

TABLES = ("cyclone_runs", "cyclone_steps", "cyclone_signals", "cyclone_graphs", "cyclone_workflows")


def counts(env: TestEnv) -> dict[str, int]:
    return {
        t: env.conn.execute(f"SELECT count(*) AS n FROM {t}").fetchone()["n"]  # fixed names
        for t in TABLES
    }


# -- workflows -------------------------------------------------------------------------------

simple = cyclone.Workflow("bad-input-simple")


@simple.task(max_attempts=3)
def only(ctx: cyclone.StepContext) -> dict[str, Any]:
    return {"ok": True}


parked = cyclone.Workflow("bad-input-parked")
parked.wait("approval", signal="approved")


class Opaque:
    """A value JSON knows nothing about."""


NON_JSON_OUTPUTS = {
    "set": ({1, 2}, "set"),
    "object": (Opaque(), "Opaque"),
    "bytes": (b"raw", "bytes"),
    "nan": (math.nan, "NaN"),
    "int-keyed dict": ({1: "one"}, "key 1"),
    "nested set": ({"a": [1, {2}]}, "set"),
}


def _returning(label: str, value: Any) -> cyclone.Workflow:
    wf = cyclone.Workflow(f"bad-input-returns-{label.replace(' ', '-')}")

    def result(ctx: cyclone.StepContext) -> Any:
        return value

    wf.task(result, max_attempts=3)
    return wf


RETURNS_NON_JSON = {
    label: _returning(label, value) for label, (value, _) in NON_JSON_OUTPUTS.items()
}


returns_too_much = cyclone.Workflow("bad-input-returns-too-much")


@returns_too_much.task(max_attempts=3)
def huge(ctx: cyclone.StepContext) -> str:
    return "x" * (MAX_PAYLOAD_BYTES + 1)


returns_nul = cyclone.Workflow("bad-input-returns-nul")


@returns_nul.task(max_attempts=3)
def nul(ctx: cyclone.StepContext) -> dict[str, str]:
    return {"text": "a\x00b"}


# -- submitting bad input ------------------------------------------------------------------------

NON_JSON_INPUTS = {
    "set": {1, 2},
    "frozenset": frozenset({"a"}),
    "object": object(),
    "custom object": Opaque(),
    "nan": math.nan,
    "infinity": math.inf,
    "int dict key": {1: "one"},
    "tuple dict key": {("a", "b"): 1},
    "bytes": b"\x00\x01",
    "bytearray": bytearray(b"x"),
    "datetime": dt.datetime(2024, 1, 1),
    "decimal": decimal.Decimal("1.5"),
    "uuid": uuid.uuid4(),
    "nested set": {"items": [1, 2, {3}]},
    "nested nan": {"a": {"b": [0.5, math.nan]}},
}


@pytest.mark.parametrize("value", NON_JSON_INPUTS.values(), ids=NON_JSON_INPUTS.keys())
def test_non_json_input_raises_type_error_and_writes_nothing(env: TestEnv, value: Any) -> None:
    env.register(simple)
    before = counts(env)
    with pytest.raises(TypeError, match="input"):
        env.client.submit(simple, value)
    with pytest.raises(TypeError, match="input"):
        env.client.submit(simple.name, value, run_deadline=60)
    with pytest.raises(TypeError, match="input"):
        cyclone.submit(env.client, simple, {"ok": [value]})
    with pytest.raises(TypeError, match=r"inputs\[1\]"):
        env.client.submit_many(simple, [{"fine": 1}, value, {"fine": 2}])
    assert counts(env) == before


def test_non_json_input_of_an_unregistered_workflow_registers_nothing(env: TestEnv) -> None:
    before = counts(env)
    with pytest.raises(TypeError):
        env.client.submit(simple, {"when": dt.date(2024, 1, 1)})
    assert counts(env) == before


def test_the_type_error_names_the_offending_part_of_the_input(env: TestEnv) -> None:
    env.register(simple)
    with pytest.raises(TypeError, match=r"input\['order'\]\['lines'\]\[1\]: set is not JSON"):
        env.client.submit(simple, {"order": {"lines": [1, {2}]}})
    with pytest.raises(TypeError, match=r"key 7 is not a string"):
        env.client.submit(simple, {"a": {7: "x"}})
    with pytest.raises(TypeError, match=r"nan is not JSON"):
        env.client.submit(simple, [math.nan])


def test_non_json_input_inside_the_callers_transaction_raises_before_writing(
    env: TestEnv,
) -> None:
    env.register(simple)
    before = counts(env)
    with connect(env.dsn) as conn, conn.transaction():
        with pytest.raises(TypeError):
            env.client.submit(simple, {"x": {1, 2}}, conn=conn)
        conn.execute("SELECT 1")  # the caller's transaction is still usable
    assert counts(env) == before


def test_an_oversized_input_raises_payload_too_large_and_writes_nothing(env: TestEnv) -> None:
    env.register(simple)
    before = counts(env)
    with cyclone.Client(env.dsn, max_payload_bytes=64) as small:
        with pytest.raises(PayloadTooLarge, match="over the payload limit of 64 bytes"):
            small.submit(simple, {"blob": "x" * 100})
        with pytest.raises(PayloadTooLarge, match=r"inputs\[2\]"):
            small.submit_many(simple, [{"a": 1}, {"b": 2}, {"blob": "x" * 100}])
        assert small.get_run(small.submit(simple, {"small": 1})).state == RunState.RUNNING
    assert counts(env)["cyclone_runs"] == before["cyclone_runs"] + 1
    before = counts(env)
    with pytest.raises(PayloadTooLarge):
        env.client.submit(simple, "x" * (MAX_PAYLOAD_BYTES + 1))
    assert counts(env) == before


def test_payload_too_large_is_a_value_error_and_a_cyclone_error() -> None:
    assert issubclass(PayloadTooLarge, ValueError)
    assert issubclass(PayloadTooLarge, cyclone.CycloneError)


def test_an_oversized_or_non_json_signal_payload_writes_nothing(env: TestEnv) -> None:
    run_id = env.client.submit(parked, {})
    before = counts(env)
    with pytest.raises(TypeError, match="payload of signal 'approved'"):
        env.client.signal(run_id, "approved", {"at": dt.datetime(2024, 1, 1)})
    with pytest.raises(PayloadTooLarge):
        env.client.signal(run_id, "approved", "x" * (MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(ValueError, match="non-empty name"):
        env.client.signal(run_id, "", {})
    assert counts(env) == before
    assert [s.state for s in env.client.steps(run_id)] == [StepState.WAITING]


def test_submitting_an_unknown_workflow_name_raises_workflow_not_found(env: TestEnv) -> None:
    env.register(simple)
    before = counts(env)
    with pytest.raises(WorkflowNotFound, match="no-such-workflow"):
        env.client.submit("no-such-workflow", {})
    with pytest.raises(WorkflowNotFound):
        env.client.submit_many("no-such-workflow", [{}, {}])
    with pytest.raises(WorkflowNotFound):
        cyclone.submit(env.client, "Bad-Input-Simple", {})  # names are case-sensitive
    assert counts(env) == before
    assert issubclass(WorkflowNotFound, cyclone.CycloneError)


@pytest.mark.parametrize("run_deadline", ["30m", True, [60], object()])
def test_a_run_deadline_that_is_not_a_duration_raises_type_error_and_writes_nothing(
    env: TestEnv, run_deadline: Any
) -> None:
    env.register(simple)
    before = counts(env)
    with pytest.raises(TypeError, match="run_deadline"):
        env.client.submit(simple, {}, run_deadline=run_deadline)
    assert counts(env) == before


@pytest.mark.parametrize(
    "run_deadline",
    [math.inf, 1e300, dt.timedelta.max, math.nan],
    ids=["inf", "1e300", "timedelta.max", "nan"],
)
def test_an_unrepresentable_run_deadline_raises_a_clear_error_and_writes_nothing(
    env: TestEnv, run_deadline: Any
) -> None:
    env.register(simple)
    before = counts(env)
    with pytest.raises((TypeError, ValueError), match="run_deadline"):
        env.client.submit(simple, {}, run_deadline=run_deadline)
    assert counts(env) == before


@pytest.mark.parametrize("key", ["", 5, b"k"])
def test_an_idempotency_key_that_is_not_a_non_empty_string_is_rejected(
    env: TestEnv, key: Any
) -> None:
    env.register(simple)
    before = counts(env)
    with pytest.raises(ValueError, match="key"):
        env.client.submit(simple, {}, key=key)
    assert counts(env) == before


# Text PostgreSQL cannot store: JSON allows "\u0000" and Python strings allow lone surrogates,
# but jsonb and text columns reject both. The contract's answer for input that cannot be stored
# is TypeError (or ValueError for names and keys), never a database error.
UNSTORABLE = {
    "nul in a string": {"text": "a\x00b"},
    "nul in a key": {"a\x00": 1},
    "lone surrogate": ["\ud800"],
}


@pytest.mark.parametrize("value", UNSTORABLE.values(), ids=UNSTORABLE.keys())
def test_input_postgresql_cannot_store_raises_type_error_and_writes_nothing(
    env: TestEnv, value: Any
) -> None:
    env.register(simple)
    before = counts(env)
    with pytest.raises(TypeError):
        env.client.submit(simple, value)
    assert counts(env) == before


def test_a_huge_integer_input_is_stored_intact_or_rejected_with_type_error(env: TestEnv) -> None:
    env.register(simple)
    before = counts(env)
    value = {"n": 10**5000}
    try:
        run_id = env.client.submit(simple, value)
    except TypeError:
        assert counts(env) == before
    else:
        assert env.client.get_run(run_id).input == value


@pytest.mark.parametrize("where", ["signal name", "signal payload", "key"])
def test_a_nul_character_in_names_and_keys_raises_a_clear_error(env: TestEnv, where: str) -> None:
    run_id = env.client.submit(parked, {})
    before = counts(env)
    with pytest.raises((TypeError, ValueError)):
        if where == "signal name":
            env.client.signal(run_id, "appr\x00ved", {})
        elif where == "signal payload":
            env.client.signal(run_id, "approved", "a\x00")
        else:
            env.client.submit(parked, {}, key="k\x00")
    assert counts(env) == before


# -- unknown and malformed run ids -----------------------------------------------------------------

MALFORMED_IDS = ["", "nope", "123", "not-a-uuid-at-all", "00000000-0000-0000-0000", "\x00", " "]


def _operations(env: TestEnv) -> dict[str, Any]:
    c = env.client
    return {
        "get_run": c.get_run,
        "cancel": c.cancel,
        "pause": c.pause,
        "resume": c.resume,
        "signal": lambda rid: c.signal(rid, "approved", {"x": 1}),
        "steps": c.steps,
    }


@pytest.mark.parametrize("op", ["get_run", "cancel", "pause", "resume", "signal", "steps"])
@pytest.mark.parametrize("run_id", [str(uuid.uuid4()), *MALFORMED_IDS])
def test_an_unknown_or_malformed_run_id_raises_run_not_found(
    env: TestEnv, op: str, run_id: str
) -> None:
    env.register(simple)
    env.client.submit(simple, {})
    before = counts(env)
    with pytest.raises(RunNotFound):
        _operations(env)[op](run_id)
    assert counts(env) == before


def test_run_not_found_is_a_lookup_error_and_a_cyclone_error() -> None:
    assert issubclass(RunNotFound, LookupError)
    assert issubclass(RunNotFound, cyclone.CycloneError)


@pytest.mark.parametrize("step_id", [987654321, -1, 2**70])
def test_an_unknown_step_id_raises_step_not_found(env: TestEnv, step_id: int) -> None:
    with pytest.raises(cyclone.StepNotFound):
        env.client.step(step_id)


@pytest.mark.parametrize("step_id", ["abc", ""])
def test_a_malformed_step_id_raises_step_not_found(env: TestEnv, step_id: str) -> None:
    with pytest.raises(cyclone.StepNotFound):
        env.client.step(step_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("step_id", [1.5, True], ids=["float", "bool"])
def test_a_step_id_that_is_not_an_integer_does_not_find_another_step(
    env: TestEnv, step_id: Any
) -> None:
    env.client.submit(simple, {})
    assert env.client.step(1).node == "only"
    with pytest.raises(cyclone.StepNotFound):
        env.client.step(step_id)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"reason": "nope"}, "unknown error kind 'nope'"),
        ({"limit": 0}, "limit"),
        ({"limit": True}, "limit"),
    ],
)
def test_a_dlq_query_with_a_bad_reason_or_limit_is_rejected_when_built(
    query: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        cyclone.ExhaustedQuery(**query)


@pytest.mark.parametrize("query", [{"since": "1h"}, {"workflow": 5}], ids=["since", "workflow"])
def test_a_dlq_query_with_a_bad_since_or_workflow_raises_a_clear_error(
    env: TestEnv, query: Any
) -> None:
    with pytest.raises((TypeError, ValueError)):
        env.client.exhausted(cyclone.ExhaustedQuery(**query))


# -- handlers returning bad values -----------------------------------------------------------------


@pytest.mark.parametrize("label", NON_JSON_OUTPUTS)
def test_a_handler_returning_non_json_dead_letters_its_step_without_retrying(
    env: TestEnv, label: str
) -> None:
    wf = RETURNS_NON_JSON[label]
    _, expected = NON_JSON_OUTPUTS[label]
    run_id = env.client.submit(wf, {})
    status = env.run_until_complete(run_id)
    assert status.state == RunState.FAILED
    assert status.error_kind == ErrorKind.ERROR
    (step,) = env.client.steps(run_id)
    assert step.state == StepState.DEAD
    assert step.error_kind == ErrorKind.ERROR
    assert step.attempt == 1, "a non-JSON result was retried"
    assert expected in (step.error or "")
    assert f"{wf.name}/result" in (step.error or "")
    assert [s.id for s in env.client.exhausted(cyclone.ExhaustedQuery(workflow=wf.name))] == [
        step.id
    ]


def test_a_handler_returning_an_oversized_value_dead_letters_its_step_without_retrying(
    env: TestEnv,
) -> None:
    run_id = env.client.submit(returns_too_much, {})
    status = env.run_until_complete(run_id)
    assert status.state == RunState.FAILED and status.error_kind == ErrorKind.ERROR
    (step,) = env.client.steps(run_id)
    assert step.state == StepState.DEAD and step.attempt == 1
    assert "over the payload limit" in (step.error or "")


def test_a_handler_returning_text_postgresql_cannot_store_dead_letters_its_step(
    env: TestEnv,
) -> None:
    run_id = env.client.submit(returns_nul, {})
    status = env.run_until_complete(run_id)
    assert status.state == RunState.FAILED and status.error_kind == ErrorKind.ERROR
    (step,) = env.client.steps(run_id)
    assert step.state == StepState.DEAD and step.attempt == 1


# -- properties --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_env() -> Iterator[TestEnv]:
    """One env for every hypothesis example of this module (counts are compared per example)."""
    with TestEnv(workflows=[simple, parked]) as env:
        yield env


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    # JSON, but not storable in PostgreSQL: these must be rejected with TypeError too.
    | st.sampled_from(["a\x00b", "\ud800"])
    | st.builds(pow, st.just(10), st.just(5000)),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children),
    max_leaves=8,
)

bad_leaves = st.one_of(
    st.sets(st.integers(), max_size=3),
    st.frozensets(st.text(max_size=3), max_size=3),
    st.binary(max_size=8),
    st.builds(bytearray, st.binary(max_size=4)),
    st.builds(object),
    st.builds(Opaque),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.complex_numbers(),
    st.dates(),
    st.datetimes(),
    st.timedeltas(),
    st.decimals(allow_nan=False),
    st.uuids(),
    st.fractions(),
    st.dictionaries(
        st.one_of(st.integers(), st.none(), st.booleans(), st.floats(allow_nan=False)),
        json_values,
        min_size=1,
        max_size=3,
    ),
    st.from_type(type),
    st.functions(),
)

non_json = st.recursive(
    bad_leaves,
    lambda bad: st.one_of(
        st.tuples(json_values, bad).map(list),
        st.builds(
            lambda k, v, rest: {**rest, k: v},
            st.text(max_size=4),
            bad,
            st.dictionaries(st.text(max_size=4), json_values, max_size=2),
        ),
    ),
    max_leaves=4,
)

HYPOTHESIS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@HYPOTHESIS
@given(value=non_json)
def test_any_non_json_input_raises_type_error_and_writes_nothing(
    shared_env: TestEnv, value: Any
) -> None:
    before = counts(shared_env)
    with pytest.raises(TypeError):
        shared_env.client.submit(simple, value)
    with pytest.raises(TypeError):
        shared_env.client.submit_many(simple.name, [{"ok": 1}, value])
    assert counts(shared_env) == before


@HYPOTHESIS
@given(payload=non_json)
def test_any_non_json_signal_payload_raises_type_error_and_writes_nothing(
    shared_env: TestEnv, payload: Any
) -> None:
    run_id = shared_env.client.submit(parked, {})
    before = counts(shared_env)
    with pytest.raises(TypeError):
        shared_env.client.signal(run_id, "approved", payload)
    assert counts(shared_env) == before


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def same_json(a: Any, b: Any) -> bool:
    """JSON equality: jsonb keeps numbers as decimals, so 2.5e16 may come back as an int."""
    if _number(a) and _number(b):
        try:
            return a == b or float(a) == float(b)
        except OverflowError:
            return False
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@HYPOTHESIS
@given(value=st.one_of(st.from_type(object), json_values, non_json))
def test_any_value_is_either_submitted_intact_or_rejected_with_a_documented_error(
    shared_env: TestEnv, value: Any
) -> None:
    before = counts(shared_env)
    try:
        run_id = shared_env.client.submit(simple, value)
    except (TypeError, PayloadTooLarge):
        assert counts(shared_env) == before
        return
    status = shared_env.client.get_run(run_id)
    assert same_json(status.input, json.loads(encode_json(value))), status.input
    assert counts(shared_env)["cyclone_runs"] == before["cyclone_runs"] + 1


@HYPOTHESIS
@given(run_id=st.one_of(st.text(), st.uuids().map(str), st.uuids().map(lambda u: u.hex)))
def test_any_text_as_a_run_id_raises_only_run_not_found(shared_env: TestEnv, run_id: str) -> None:
    before = counts(shared_env)
    for op in _operations(shared_env).values():
        with pytest.raises(RunNotFound):
            op(run_id)
    assert counts(shared_env) == before


@HYPOTHESIS
@given(name=st.text(), payload=json_values)
def test_any_text_as_a_signal_name_is_kept_or_rejected_with_value_error(
    shared_env: TestEnv, name: str, payload: Any
) -> None:
    run_id = shared_env.client.submit(parked, {})
    before = counts(shared_env)
    try:
        # No wait node of `parked` listens for most names: kept, with a warning (item 3).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cyclone.UnheardSignal)
            delivered = shared_env.client.signal(run_id, name, payload)
    except (ValueError, TypeError):  # PayloadTooLarge is a ValueError
        assert counts(shared_env) == before
        return
    assert delivered is True
    assert counts(shared_env)["cyclone_signals"] == before["cyclone_signals"] + 1


# Any text PostgreSQL can store (no NUL; lone surrogates cannot be encoded at all).
stored_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))


@HYPOTHESIS
@given(names=st.lists(stored_text, max_size=5))
def test_the_text_array_literal_reads_back_as_the_same_names(
    shared_env: TestEnv, names: list[str]
) -> None:
    # Workflow names reach the lease query as one literal (quotes, backslashes, braces, commas,
    # spaces and the word NULL included), made once per worker.
    row = shared_env.conn.execute("SELECT %s::text[] AS names", (text_array(tuple(names)),))
    assert row.fetchone()["names"] == names

"""The trace context current at submit is stored with the run; a child run inherits it.

SPEC section 16: sync and async clients, submit_many and the CLI (through TRACEPARENT, the
environment carrier) all store the W3C traceparent of the span current in the submitting code;
the supervisor parents each attempt's span to it (tests/process/test_process_traces.py).
"""

from __future__ import annotations

import asyncio

import pytest
from cli_support import run_cli

import cyclone
from cyclone.testing import TestEnv
from cyclone.tracecontext import ENV_TRACEPARENT, current_traceparent, is_traceparent

sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")

one = cyclone.Workflow("traced-one")


@one.task()
def only(ctx):
    return 1


kid = cyclone.Workflow("traced-kid")


@kid.task()
def leaf(ctx):
    return 2


parent = cyclone.Workflow("traced-parent")
parent.child("sub", kid)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def no_env_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TRACEPARENT, raising=False)


def stored(env: TestEnv, run_id: str) -> str | None:
    row = env.conn.execute("SELECT trace_parent FROM cyclone_runs WHERE id = %s", [run_id])
    return row.fetchone()["trace_parent"]


def header(span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def test_submit_and_submit_many_store_the_current_span(env: TestEnv) -> None:
    tracer = sdk.TracerProvider().get_tracer("web")
    with tracer.start_as_current_span("POST /orders") as span:
        run_id = env.client.submit(one)
        many = env.client.submit_many(one, [1, 2])
    assert is_traceparent(header(span))
    assert [stored(env, r) for r in [run_id, *many]] == [header(span)] * 3
    assert stored(env, env.client.submit(one)) is None  # no span current, no variable


def test_the_async_client_stores_the_span_of_its_task(env: TestEnv) -> None:
    tracer = sdk.TracerProvider().get_tracer("web")

    async def handler() -> tuple[str, str]:
        async with cyclone.AsyncClient(env.dsn) as client:
            with tracer.start_as_current_span("GET /async") as span:
                return await client.submit(one), header(span)

    run_id, expected = asyncio.run(handler())
    assert stored(env, run_id) == expected


def test_a_child_run_inherits_its_parents_context(env: TestEnv) -> None:
    tracer = sdk.TracerProvider().get_tracer("web")
    with tracer.start_as_current_span("POST /parent") as span:
        run_id = env.client.submit(parent)
    assert env.run_until_complete(run_id).state == cyclone.RunState.COMPLETED
    row = env.conn.execute(
        "SELECT trace_parent FROM cyclone_runs WHERE parent_run_id = %s", [run_id]
    ).fetchone()
    assert row["trace_parent"] == header(span) == stored(env, run_id)


def test_the_cli_stores_the_traceparent_variable(env: TestEnv, capsys, monkeypatch) -> None:
    env.client.submit(one)  # registers the workflow, which the CLI submits by name
    monkeypatch.setenv(ENV_TRACEPARENT, TRACEPARENT)
    result = run_cli(capsys, env, "submit", "traced-one", "--json")
    assert result.code == 0, result.err
    assert stored(env, result.json()["run_id"]) == TRACEPARENT


@pytest.mark.parametrize(
    "bad",
    [
        "garbage",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero span id
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # unknown version
        TRACEPARENT + "-extra",
    ],
)
def test_a_malformed_variable_is_ignored_not_an_error(
    env: TestEnv, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv(ENV_TRACEPARENT, bad)
    assert current_traceparent() is None
    assert stored(env, env.client.submit(one)) is None

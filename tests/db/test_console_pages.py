"""The web console over HTTP (served from a thread, on the test database): its pages, its
filters and paging, its escaping, and the guard around its actions (token, CSRF, Origin,
Host). The browser tests (tests/process/test_console_browser.py) click through the same."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from console_server import TOKEN, Browser, serve
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from psycopg import sql
from psycopg.conninfo import make_conninfo

import cyclone
from cyclone.console import reads
from cyclone.console.app import ConsoleSettings, Database
from cyclone.testing import TestEnv

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'

flaky = cyclone.Workflow("console-flaky")
hostile = cyclone.Workflow(f"console-{HOSTILE}")
slow = cyclone.Workflow("console-slow")


@flaky.task(max_attempts=2)
def fails(ctx):
    if (ctx.input or {}).get("ok"):
        return "fine"
    raise RuntimeError(f"payment gateway said no: {ctx.input['n']}")


@hostile.task(max_attempts=1)
def hostile_step(ctx):
    raise RuntimeError(HOSTILE)


slow.wait("approval", signal="go")


@pytest.fixture
def console(env: TestEnv) -> Iterator[Browser]:
    env.register(flaky, hostile, slow)
    with serve(env.dsn, token=TOKEN) as base:
        yield Browser(base)


@pytest.fixture
def readonly(env: TestEnv) -> Iterator[Browser]:
    env.register(flaky, hostile, slow)
    with serve(env.dsn) as base:
        yield Browser(base)


def _fail_runs(env: TestEnv, n: int, deadline: timedelta | None = None) -> list[str]:
    ids = env.client.submit_many(flaky, [{"n": i} for i in range(n)], run_deadline=deadline)
    env.run_until_idle()
    env.advance_time(timedelta(minutes=10))
    env.run_until_idle()
    return ids


def test_every_page_renders_and_says_why_a_run_failed(env: TestEnv, console: Browser):
    (run_id,) = _fail_runs(env, 1)
    for path in ("/", "/runs", "/dlq", "/limits", "/schedules", "/fleet", f"/runs/{run_id}"):
        got = console.get(path)
        assert got.status == 200, (path, got.text[:300])
    page = console.get(f"/runs/{run_id}").text
    assert 'id="kill-reason">error<' in page
    assert "payment gateway said no: 0" in page
    # Both attempts, each with its whole error (a traceback: several lines).
    assert page.count("attempt 1 ·") == 1 and page.count("attempt 2 ·") == 1
    assert "Traceback (most recent call last)" in page


def test_names_and_errors_are_escaped_everywhere(env: TestEnv, console: Browser):
    env.client.submit(hostile, {"note": HOSTILE})
    env.run_until_idle()
    run_id = env.conn.execute(
        "SELECT id::text FROM cyclone_runs WHERE workflow = %s", (hostile.name,)
    ).fetchone()["id"]
    for path in ("/runs", "/dlq", f"/runs/{run_id}", "/limits", "/runs?error=%3Cscript"):
        text = console.get(path).text
        assert "<script>alert" not in text and "<img src=x" not in text, path
        assert "&lt;script&gt;" in text, path


def test_the_console_is_read_only_without_a_token(env: TestEnv, readonly: Browser):
    (run_id,) = _fail_runs(env, 1)
    step = env.client.exhausted()[0]
    page = readonly.get("/dlq").text
    assert "read-only" in page and 'action="/actions/retry"' in page  # the form, no buttons
    assert "retry-selected" not in page and 'name="step_id"' not in page
    got = readonly.post("/actions/retry", [("step_id", str(step.id)), ("csrf", "x")])
    assert got.status == 403 and "no [console] token" in got.problem()
    assert readonly.sign_in().status == 403
    assert env.client.get_run(run_id).state == "failed"


def test_the_pages_read_as_the_read_only_role(env: TestEnv, pg_dsn: str):
    """A role with SELECT only browses every page; the read sessions refuse writes even to a
    role that could write."""
    _fail_runs(env, 1)
    role = f"console_ro_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
            sql.Identifier(env.schema), sql.Identifier(role)))  # fmt: skip
        admin.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(
            sql.Identifier(env.schema), sql.Identifier(role)))  # fmt: skip
    try:
        dsn = make_conninfo(pg_dsn, user=role, options=f"-c search_path={env.schema}")
        run_id = env.client.exhausted()[0].run_id
        with serve(dsn) as base:
            b = Browser(base)
            for path in ("/", "/runs", "/dlq", "/limits", "/schedules", "/fleet",
                         f"/runs/{run_id}", "/runs?error=gateway&state=failed"):  # fmt: skip
                got = b.get(path)
                assert got.status == 200, (path, got.problem())
        with serve(env.dsn):
            db = Database(ConsoleSettings(dsn=env.dsn))
            db.open()
            try:
                with db.read() as conn, pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                    conn.execute("UPDATE cyclone_runs SET state = state")
            finally:
                db.close()
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_signing_in_needs_the_token_and_the_forms_own_nonce(env: TestEnv, console: Browser):
    assert console.sign_in("wrong-token-0123456789").status == 403
    assert "cyclone_console_session" not in console.cookies
    # A sign-in posted from elsewhere: no nonce cookie of this browser's.
    stranger = Browser(console.base)
    got = stranger.post("/login", [("nonce", "guess"), ("token", TOKEN)])
    assert got.status == 403 and "cyclone_console_session" not in stranger.cookies
    assert console.sign_in().status == 303
    assert "cyclone_console_session" in console.cookies
    assert "retry-selected" in console.get("/dlq").text


def test_an_action_without_the_pages_csrf_token_or_from_another_origin_changes_nothing(
    env: TestEnv, console: Browser
):
    (run_id,) = _fail_runs(env, 1)
    step = env.client.exhausted()[0]
    console.sign_in()
    csrf = console.get("/dlq").field("csrf")
    forged = [
        ([("step_id", str(step.id))], {}),  # no token
        ([("step_id", str(step.id)), ("csrf", "0" * 64)], {}),  # a wrong one
        ([("step_id", str(step.id)), ("csrf", csrf)], {"Origin": "http://evil.example"}),
    ]
    for form, headers in forged:
        got = console.post("/actions/retry", form, headers=headers)
        assert got.status == 403 and "CSRF" in got.problem(), got.text[:300]
    # Another browser (no session) with the real token is refused as well.
    got = Browser(console.base).post("/actions/retry", [("step_id", str(step.id)),
                                                        ("csrf", csrf)])  # fmt: skip
    assert got.status == 403 and "sign in" in got.problem()
    assert env.client.get_run(run_id).state == "failed"
    got = console.post("/actions/retry", [("step_id", str(step.id)), ("csrf", csrf)],
                       headers={"Origin": console.base})  # fmt: skip
    assert got.status == 200 and "1 of 1 done" in got.text
    assert env.client.get_run(run_id).state == "running"


def test_signing_out_ends_the_session(env: TestEnv, console: Browser):
    console.sign_in()
    session = console.cookies["cyclone_console_session"]
    csrf = console.get("/dlq").field("csrf")
    assert console.post("/logout", [("csrf", csrf)]).status == 303
    replay = Browser(console.base, {"cyclone_console_session": session})
    got = replay.post("/actions/cancel", [("run_id", str(uuid.uuid4())), ("csrf", csrf)])
    assert got.status == 403 and "sign in" in got.problem()


def test_a_host_other_than_loopback_is_refused_and_every_answer_carries_the_headers(
    console: Browser,
):
    got = console.get("/runs", headers={"Host": "evil.example:8465"})
    assert got.status == 421
    got = console.get("/runs")
    csp = got.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert got.headers["x-frame-options"] == "DENY"
    assert got.headers["cache-control"] == "no-store"
    assert "server" not in got.headers or "uvicorn" not in got.headers["server"]


def test_bulk_retry_with_a_new_deadline_runs_the_runs_again(env: TestEnv, console: Browser):
    ids = _fail_runs(env, 3, deadline=timedelta(minutes=5))  # failed by their deadline
    steps = env.client.exhausted()
    assert {s.error_kind for s in steps} == {"deadline"}
    console.sign_in()
    csrf = console.get("/dlq?reason=deadline").field("csrf")
    form = [("step_id", str(s.id)) for s in steps] + [("csrf", csrf)]
    refused = console.post("/actions/retry", [*form, ("deadline", "")])
    assert "0 of 3 done" in refused.text and "needs a new one" in refused.text
    bad = console.post("/actions/retry", [*form, ("deadline", "-5m")])
    assert bad.status == 400 and bad.problem().startswith("deadline:")
    done = console.post("/actions/retry", [*form, ("deadline", "30m")])
    assert "3 of 3 done" in done.text, done.text
    for run_id in ids:
        st_ = env.client.get_run(run_id)
        assert st_.state == "running" and st_.deadline_at is not None


def test_bulk_cancel_cancels_the_selected_runs_only(env: TestEnv, console: Browser):
    ids = env.client.submit_many(slow, [None] * 4)
    env.run_until_idle()
    console.sign_in()
    page = console.get("/runs?workflow=console-slow")
    assert all(f'value="{i}"' in page.text for i in ids)
    form = [("run_id", i) for i in ids[:3]] + [("csrf", page.field("csrf")),
                                               ("back", "/runs")]  # fmt: skip
    done = console.post("/actions/cancel", form)
    assert "3 of 3 done" in done.text
    states = [env.client.get_run(i).state for i in ids]
    assert states == ["cancelled"] * 3 + ["running"]
    again = console.post("/actions/cancel", form)
    assert "0 of 3 done" in again.text and "already finished" in again.text


def test_runs_filter_by_error_text_state_and_workflow(env: TestEnv, console: Browser):
    _fail_runs(env, 3)
    env.client.submit_many(slow, [None] * 2)
    env.run_until_idle()
    text = console.get("/runs?error=GATEWAY+said+no%3A+1").text
    assert len(re.findall(r'href="/runs/[0-9a-f-]{36}"', text)) == 1
    text = console.get("/runs?state=running").text
    assert len(re.findall(r'href="/runs/[0-9a-f-]{36}"', text)) == 2
    assert "console-slow" in text and "console-flaky" not in text
    # % and _ are plain characters, not patterns.
    text = console.get("/runs?error=%25").text
    assert "No run matches." in text


def test_paging_walks_every_run_once_and_a_sparse_filter_searches_window_by_window(
    env: TestEnv, console: Browser, monkeypatch: pytest.MonkeyPatch
):
    ids = set(env.client.submit_many(slow, [None] * 120))
    seen: list[str] = []
    path: str | None = "/runs"
    while path:
        text = console.get(path.replace("&amp;", "&")).text
        seen += re.findall(r'<td class="id" data-label="run"><a href="/runs/([0-9a-f-]{36})"', text)
        found = re.search(r'href="([^"]+)" id="older"', text)
        path = found.group(1) if found else None
    assert len(seen) == len(set(seen)) == 120 and set(seen) == ids
    # A filter that matches one run in 120, with windows of 50: the first page searched 50
    # and found nothing, and offers to search on.
    env.client.submit(flaky, {"ok": True})
    env.client.submit_many(slow, [None] * 10)
    monkeypatch.setattr(reads, "SCAN", 50)
    matches = 0
    path = "/runs?workflow=console-flaky"
    windows = 0
    while path:
        text = console.get(path.replace("&amp;", "&")).text
        windows += 1
        matches += len(re.findall(r'data-label="run"><a href="/runs/', text))
        found = re.search(r'href="([^"]+)" id="older"', text)
        path = found.group(1) if found else None
    assert matches == 1 and windows == 3  # 131 runs: windows of 50, 50, 31


@hsettings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(["state", "workflow", "queue", "key", "error", "since", "until",
                          "before"]),
    value=st.text(st.characters(blacklist_categories=("Cs",)), max_size=300),
)  # fmt: skip
def test_any_filter_value_gets_a_page_or_one_clear_message(console: Browser, name, value):
    from urllib.parse import urlencode

    got = console.get("/runs?" + urlencode({name: value}))
    assert got.status in (200, 400), (name, value, got.status)
    if got.status == 400:
        assert got.problem().startswith(f"{name}:"), got.problem()


def test_a_run_that_carries_a_trace_links_to_it(env: TestEnv):
    """Where runs store their W3C traceparent (a `trace_parent` column, with tracing on), the
    run's page links the configured trace_url; on a schema without the column, nothing."""
    env.register(slow)
    (run_id,) = env.client.submit_many(slow, [None])
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with serve(env.dsn, trace_url="https://jaeger.internal/trace/{trace_id}") as base:
        assert "trace-link" not in Browser(base).get(f"/runs/{run_id}").text
        env.conn.execute("ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS trace_parent text")
        env.conn.execute(
            "UPDATE cyclone_runs SET trace_parent = %s WHERE id = %s",
            (f"00-{trace}-00f067aa0ba902b7-01", run_id),
        )
        page = Browser(base).get(f"/runs/{run_id}").text
    assert f'href="https://jaeger.internal/trace/{trace}"' in page

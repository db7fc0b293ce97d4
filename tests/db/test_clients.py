"""One suite, run against Client and AsyncClient alike (see client_faces.py).

The `client` fixture is the env's own client of each kind: its wait runs the run to its end in
process (the harness). `plain` is a client of each kind with no harness, for real waiting.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from client_faces import KINDS, make

import cyclone
from cyclone.clients import waiting
from cyclone.clients.calls import Statement
from cyclone.states import ErrorKind, RunState, StepState
from cyclone.testing import TestEnv

task_wf = cyclone.Workflow("clients-task")


@task_wf.task()
def double(ctx):
    return ctx.input["n"] * 2


wait_wf = cyclone.Workflow("clients-wait")
wait_wf.wait("approval", signal="approved")

failing_wf = cyclone.Workflow("clients-fail")


@failing_wf.task(max_attempts=1)
def boom(ctx):
    raise cyclone.PermanentError("no stock")


child_wf = cyclone.Workflow("clients-child")
child_wf.wait("hold", signal="go")
parent_wf = cyclone.Workflow("clients-parent")
parent_wf.child("kid", child_wf)


@pytest.fixture(params=KINDS)
def client(request, env: TestEnv):
    c = make(request.param, lambda cls: env.client if cls is cyclone.Client else env.async_client())
    yield c
    if request.param == "async":
        c.close()


@pytest.fixture(params=KINDS)
def plain(request, env: TestEnv):
    c = make(request.param, lambda cls: cls(env.dsn))
    yield c
    c.close()


def _count(env: TestEnv, table: str) -> int:
    return env.conn.execute(f"SELECT count(*) AS n FROM {table}").fetchone()["n"]


# -- submitting and reading ---


def test_submit_get_run_steps_step_and_result(client, env: TestEnv):
    run_id = client.submit(task_wf, {"n": 21}, run_deadline=timedelta(minutes=5))
    st = client.get_run(run_id)
    assert (st.state, st.workflow, st.input) == (RunState.RUNNING, "clients-task", {"n": 21})
    assert st.deadline_at is not None
    [step] = client.steps(run_id)
    assert (step.node, step.state) == ("double", StepState.AVAILABLE)
    assert client.step(step.id) == client.step(str(step.id)) == step
    assert client.result(run_id) == {"double": 42}
    assert client.wait(run_id).state == RunState.COMPLETED


def test_submit_by_name_and_submit_many_keep_the_order(client, env: TestEnv):
    env.register(task_wf)
    one = client.submit("clients-task", {"n": 1})
    ids = client.submit_many("clients-task", [{"n": i} for i in range(3)])
    assert client.submit_many(task_wf, []) == []
    assert [client.get_run(r).input for r in ids] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert client.result(one) == {"double": 2}
    assert _count(env, "cyclone_runs") == 4


def test_a_key_returns_the_first_run_and_writes_nothing(client, env: TestEnv):
    first = client.submit(wait_wf, {"a": 1}, key="order-7")
    assert client.submit(wait_wf, {"a": 2}, key="order-7") == first
    assert (_count(env, "cyclone_runs"), _count(env, "cyclone_steps")) == (1, 1)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "says"),
    [
        ((wait_wf, {"x": {1, 2}}), {}, TypeError, "input"),
        ((wait_wf, {}), {"key": ""}, ValueError, "key"),
        ((wait_wf, {}), {"key": "a\x00b"}, ValueError, "NUL"),
        ((wait_wf, {}), {"run_deadline": "1h"}, TypeError, "run_deadline"),
        ((42, {}), {}, TypeError, "workflow"),
        (("no-such-workflow", {}), {}, cyclone.WorkflowNotFound, "no-such-workflow"),
    ],
)
def test_bad_submits_say_what_is_wrong_and_write_nothing(
    client, env: TestEnv, args, kwargs, error, says
):
    with pytest.raises(error, match=says):
        client.submit(*args, **kwargs)
    with pytest.raises(TypeError, match=r"inputs\[1\]"):
        client.submit_many(wait_wf, [{}, {1, 2}])
    assert _count(env, "cyclone_runs") == 0


def test_missing_and_malformed_ids_are_not_found(client):
    missing = "00000000-0000-0000-0000-000000000000"
    for call in (client.get_run, client.steps, client.wait, client.result, client.cancel):
        with pytest.raises(cyclone.RunNotFound, match="not a run id"):
            call("nope")
    for call in (client.get_run, client.steps):
        with pytest.raises(cyclone.RunNotFound, match=missing):
            call(missing)
    for bad in ("1.5", True, -1, 2**63):
        with pytest.raises(cyclone.StepNotFound, match="not a step id"):
            client.step(bad)
    with pytest.raises(cyclone.StepNotFound):
        client.step(2**62)


def test_exhausted_lists_dead_steps_by_reason_and_age(client, env: TestEnv):
    run_id = client.submit(failing_wf, {})
    with pytest.raises(cyclone.RunFailed) as failed:
        client.result(run_id)
    assert failed.value.error_kind == ErrorKind.ERROR
    assert "no stock" in failed.value.error
    [dead] = client.exhausted(cyclone.ExhaustedQuery(reason="error", since=timedelta(hours=1)))
    assert (dead.run_id, dead.node) == (run_id, "boom")
    assert client.exhausted(cyclone.ExhaustedQuery(reason="deadline")) == []
    with pytest.raises(TypeError, match="ExhaustedQuery"):
        client.exhausted("permanent")


# -- control ---


def test_pause_resume_signal_and_cancel_say_whether_they_changed_the_run(client, env: TestEnv):
    run_id = client.submit(wait_wf, {})
    assert (client.pause(run_id), client.pause(run_id)) == (True, False)
    assert (client.resume(run_id), client.resume(run_id)) == (True, False)
    with pytest.raises(ValueError, match="non-empty name"):
        client.signal(run_id, "")
    assert client.signal(run_id, "approved", {"by": "ops"}) is True
    assert client.result(run_id) == {"approval": {"by": "ops"}}
    assert client.signal(run_id, "approved") is False

    other = client.submit(wait_wf, {})
    assert (client.cancel(other), client.cancel(other)) == (True, False)
    with pytest.raises(cyclone.RunCancelled) as cancelled:
        client.result(other)
    assert (cancelled.value.run_id, cancelled.value.error_kind) == (other, "cancelled")
    assert client.wait(other).error == "run cancelled"


def test_cancelling_a_child_run_fails_its_parent_in_the_same_call(client, env: TestEnv):
    run_id = client.submit(parent_wf, {})
    env.run_until_idle()
    child_id = next(s for s in client.steps(run_id) if s.node == "kid")
    kid = env.conn.execute(
        "SELECT child_run_id FROM cyclone_steps WHERE id = %s", (child_id.id,)
    ).fetchone()["child_run_id"]
    assert client.cancel(str(kid)) is True
    st = client.get_run(run_id)
    assert (st.state, st.error_kind) == (RunState.FAILED, ErrorKind.CHILD_FAILED)
    assert "was cancelled" in st.error


# -- the harness: waits run the run, deadlines included ---


def test_the_harness_runs_a_run_past_its_deadline_when_its_result_is_awaited(client, env: TestEnv):
    run_id = client.submit(wait_wf, {}, run_deadline=timedelta(hours=1))
    with pytest.raises(cyclone.RunFailed) as failed:
        client.result(run_id)
    assert (failed.value.error_kind, failed.value.error) == ("deadline", "run deadline exceeded")
    assert "deadline: run deadline exceeded" in str(failed.value)


def test_the_harness_says_at_once_when_a_run_can_only_wait_for_a_signal(client, env: TestEnv):
    run_id = client.submit(wait_wf, {})
    with pytest.raises(cyclone.RunStuck, match="approval"):
        client.wait(run_id, timeout=60)


# -- waiting for real ---


def _nothing():
    yield Statement("clock_now", None, "one")


def _end_later(plain, env: TestEnv, run_id: str, ready) -> threading.Thread:
    """Cancel the run from another session once `ready()` holds (polled, 5 s at most)."""

    def go() -> None:
        deadline = time.monotonic() + 5
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.005)
        env.client.cancel(run_id)

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def _waiting_for(plain, run_id: str):
    return lambda: plain.watch is not None and run_id in plain.watch._waiting


def test_wait_wakes_on_the_notification_of_the_run_end(plain, env: TestEnv, monkeypatch):
    # Polls so rare that only the notification can wake the wait in time.
    monkeypatch.setattr(waiting, "POLL_HEARD", 60.0)
    monkeypatch.setattr(waiting, "POLL_UNHEARD", 60.0)
    run_id = plain.submit(wait_wf, {})

    def listening() -> bool:
        watch = plain.watch
        return _waiting_for(plain, run_id)() and watch.listening and watch.heard

    thread = _end_later(plain, env, run_id, listening)
    started = time.monotonic()
    st = plain.wait(run_id, timeout=20)
    thread.join()
    assert st.state == RunState.CANCELLED
    assert time.monotonic() - started < 10
    assert plain.watch.mode == "LISTEN/NOTIFY"


@pytest.mark.parametrize("how", ["listen=False", "notifications lost"])
def test_wait_wakes_by_polling_when_notifications_cannot_arrive(env: TestEnv, monkeypatch, how):
    monkeypatch.setattr(waiting, "POLL_UNHEARD", 0.05)
    monkeypatch.setattr(waiting, "POLL_HEARD", 60.0)
    monkeypatch.setattr(waiting, "PROBE_TIMEOUT", 0.1)
    if how == "notifications lost":
        # As behind PgBouncer in transaction mode: LISTEN succeeds, nothing arrives.
        monkeypatch.setattr(waiting, "probe_call", lambda token: _nothing())
    for kind in KINDS:
        plain = make(kind, lambda cls: cls(env.dsn, listen=how == "notifications lost"))
        try:
            run_id = plain.submit(wait_wf, {})
            thread = _end_later(plain, env, run_id, _waiting_for(plain, run_id))
            assert plain.wait(run_id, timeout=20).state == RunState.CANCELLED
            thread.join()
            assert (plain.watch.heard, plain.watch.listening) == (False, False)
            assert plain.watch.interval == 0.05
        finally:
            plain.close()


def test_wait_times_out_with_a_timeout_error_and_takes_no_bad_timeout(plain, env: TestEnv):
    run_id = plain.submit(wait_wf, {})
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"run {run_id} did not end within 0.2s"):
        plain.wait(run_id, timeout=0.2)
    assert 0.2 <= time.monotonic() - started < 5
    with pytest.raises(TimeoutError):
        plain.result(run_id, timeout=timedelta(0))
    with pytest.raises(TypeError, match="timeout"):
        plain.wait(run_id, timeout="1s")
    assert plain.watch._waiting == {}  # timed-out waiters leave nothing behind
    env.client.cancel(run_id)
    assert plain.wait(run_id, timeout=0).state == RunState.CANCELLED

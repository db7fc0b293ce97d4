"""Runs per key (`Concurrency`): at most `limit` runs of one key are active, the others wait
as `queued` and are admitted oldest first within priority as active ones end; queued runs can
be cancelled, paused and resumed, and fail by their deadline like any other run."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import cyclone
from cyclone.errors import GraphError
from cyclone.states import ErrorKind, RunState
from cyclone.testing import TestEnv

sync = cyclone.Workflow("ck-sync", concurrency=cyclone.Concurrency(key="account", limit=1))
pair = cyclone.Workflow("ck-pair", concurrency=cyclone.Concurrency(key="account", limit=2))
coded = cyclone.Workflow(
    "ck-coded", concurrency=cyclone.Concurrency(key=lambda inp: inp["tenant"] * 10, limit=1)
)


@sync.task()
def pull(ctx):
    return None


sync.wait("go", after=[pull])


@pair.task()
def pull2(ctx):
    return None


pair.wait("go", after=[pull2])


@coded.task()
def c(ctx):
    return None


coded.wait("go", after=[c])

parent = cyclone.Workflow("ck-parent")
parent.child("kid", sync, input=lambda ctx: ctx.input)

ALL = [sync, pair, coded, parent]


def states(env: TestEnv, run_ids: list[str]) -> list[str]:
    return [env.client.get_run(r).state.value for r in run_ids]


def finish(env: TestEnv, run_id: str) -> None:
    """Let an active run end (its wait gets its signal) and run what that admits."""
    assert env.client.signal(run_id, "go")
    env.run_until_idle()


def test_one_run_per_key_is_active_and_the_rest_queue_in_submit_order(env: TestEnv):
    env.register(*ALL)
    a = [env.client.submit(sync, {"account": "A"}) for _ in range(3)]
    b = env.client.submit(sync, {"account": "B"})
    env.run_until_idle()
    assert states(env, [*a, b]) == ["running", "queued", "queued", "running"]
    # Queued runs have no steps: nothing of theirs is leased or counted as due.
    assert env.client.steps(a[1]) == []
    finish(env, a[0])
    assert states(env, a) == ["completed", "running", "queued"]
    finish(env, a[1])
    finish(env, a[2])
    assert states(env, [*a, b]) == ["completed", "completed", "completed", "running"]


def test_a_limit_of_two_keeps_two_active_and_submit_many_queues_the_rest(env: TestEnv):
    env.register(*ALL)
    runs = env.client.submit_many(pair, [{"account": 7}] * 5)
    env.run_until_idle()
    assert states(env, runs) == ["running", "running", "queued", "queued", "queued"]
    finish(env, runs[1])
    assert states(env, runs) == ["running", "completed", "running", "queued", "queued"]


def test_queued_runs_are_admitted_by_priority_then_submit_time(env: TestEnv):
    env.register(*ALL)
    first = env.client.submit(sync, {"account": "A"})
    later = env.client.submit(sync, {"account": "A"})
    urgent = env.client.submit(sync, {"account": "A"}, priority=1)
    env.run_until_idle()
    finish(env, first)
    assert states(env, [later, urgent]) == ["queued", "running"]


def test_cancelling_an_active_run_admits_the_next_and_a_queued_one_frees_nothing(env: TestEnv):
    env.register(*ALL)
    a = [env.client.submit(sync, {"account": "A"}) for _ in range(3)]
    env.run_until_idle()
    assert env.client.cancel(a[1])  # queued: it held no slot
    assert states(env, a) == ["running", "cancelled", "queued"]
    assert env.client.cancel(a[0])
    env.run_until_idle()
    assert states(env, a) == ["cancelled", "cancelled", "running"]


def test_a_paused_queued_run_waits_out_its_turn_and_resumes_to_the_queue(env: TestEnv):
    env.register(*ALL)
    a = [env.client.submit(sync, {"account": "A"}) for _ in range(3)]
    env.run_until_idle()
    assert env.client.pause(a[1])
    assert states(env, a) == ["running", "paused", "queued"]
    finish(env, a[0])  # the slot goes to the next queued run, not to the paused one
    assert states(env, a) == ["completed", "paused", "running"]
    assert env.client.resume(a[1])
    assert states(env, a) == ["completed", "queued", "running"]
    finish(env, a[2])
    assert states(env, a) == ["completed", "running", "completed"]


def test_a_resumed_queued_run_is_admitted_at_once_when_a_slot_is_free(env: TestEnv):
    env.register(*ALL)
    a = [env.client.submit(sync, {"account": "A"}) for _ in range(2)]
    env.run_until_idle()
    assert env.client.pause(a[1])
    finish(env, a[0])
    assert states(env, a) == ["completed", "paused"]
    assert env.client.resume(a[1])
    assert states(env, a) == ["completed", "running"]


def test_a_queued_run_fails_by_its_deadline_from_submit(env: TestEnv):
    env.register(*ALL)
    active = env.client.submit(sync, {"account": "A"})
    waiting = env.client.submit(sync, {"account": "A"}, run_deadline=timedelta(minutes=5))
    env.run_until_idle()
    env.advance_time(timedelta(minutes=6))
    env.run_until_idle()
    status = env.client.get_run(waiting)
    assert status.state == RunState.FAILED
    assert status.error_kind == ErrorKind.DEADLINE and status.error == "run deadline exceeded"
    assert states(env, [active]) == ["running"]
    finish(env, active)  # nothing left to admit: the failed run held no slot


def test_a_key_from_code_and_keys_of_several_kinds(env: TestEnv):
    env.register(*ALL)
    runs = [env.client.submit(coded, {"tenant": t}) for t in (1, 1, 2)]
    env.run_until_idle()
    assert states(env, runs) == ["running", "queued", "running"]
    keys = env.conn.execute(
        "SELECT concurrency_key AS k FROM cyclone_runs WHERE workflow = %s ORDER BY created_at",
        (coded.name,),
    ).fetchall()
    assert [r["k"] for r in keys] == ["10", "10", "20"]


@pytest.mark.parametrize(
    ("inp", "message"),
    [
        ({}, "the input has no field 'account'"),
        ([1], "the input has no field 'account'"),
        ({"account": None}, "expected a non-empty string or an integer"),
        ({"account": ""}, "expected a non-empty string or an integer"),
        ({"account": {"x": 1}}, "expected a non-empty string or an integer"),
        ({"account": "x" * 201}, "at most 200 characters"),
    ],
)
def test_an_input_without_a_usable_key_is_refused_and_writes_nothing(
    env: TestEnv, inp: object, message: str
):
    env.register(*ALL)
    with pytest.raises(ValueError, match=message):
        env.client.submit(sync, inp)
    with pytest.raises(ValueError, match=message):
        env.client.submit_many(sync, [{"account": "ok"}, inp])
    assert env.conn.execute("SELECT count(*) AS n FROM cyclone_runs").fetchone()["n"] == 0


def test_by_name_a_field_key_works_and_a_key_in_code_is_refused(env: TestEnv):
    env.register(*ALL)
    by_name = env.client.submit("ck-sync", {"account": "A"})
    second = env.client.submit("ck-sync", {"account": "A"})
    assert states(env, [by_name, second]) == ["running", "queued"]
    with pytest.raises(ValueError, match="computes its concurrency key in code"):
        env.client.submit("ck-coded", {"tenant": 1})


@pytest.mark.parametrize(
    "bad",
    [lambda: cyclone.Concurrency(key="", limit=1), lambda: cyclone.Concurrency(key="a", limit=0),
     lambda: cyclone.Concurrency(key=3, limit=1),  # type: ignore[arg-type]
     lambda: cyclone.Workflow("ck-bad", concurrency=2)],  # type: ignore[arg-type]
)  # fmt: skip
def test_a_bad_concurrency_is_refused_when_defined(bad):
    with pytest.raises(GraphError):
        bad()


class KeyedRuns(RuleBasedStateMachine):
    """Random submits, ends, cancels, pauses and resumes of keyed runs (limit 2): never more
    than the limit active per key, and never a run queued while its key has a free slot."""

    env: TestEnv

    def __init__(self) -> None:
        super().__init__()
        self.env.conn.execute("DELETE FROM cyclone_steps")
        self.env.conn.execute("DELETE FROM cyclone_runs")
        self.runs: dict[str, str] = {}  # run id -> key
        self.order: list[str] = []

    def _state(self, run_id: str) -> str:
        return self.env.client.get_run(run_id).state.value

    @rule(key=st.sampled_from(["A", "B"]), n=st.integers(1, 3))
    def submit(self, key: str, n: int) -> None:
        for run_id in self.env.client.submit_many(pair, [{"account": key}] * n):
            self.runs[run_id] = key
            self.order.append(run_id)
        self.env.run_until_idle()

    def _pick(self, data: st.DataObject, states: set[str]) -> str | None:
        live = [r for r in self.order if self._state(r) in states]
        return data.draw(st.sampled_from(live)) if live else None

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        run_id = self._pick(data, {"running"})
        if run_id is not None:
            finish(self.env, run_id)

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        run_id = self._pick(data, {"running", "queued", "paused"})
        if run_id is not None:
            assert self.env.client.cancel(run_id)
            self.env.run_until_idle()

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def pause(self, data: st.DataObject) -> None:
        run_id = self._pick(data, {"running", "queued"})
        if run_id is not None:
            assert self.env.client.pause(run_id)

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        run_id = self._pick(data, {"paused"})
        if run_id is not None:
            assert self.env.client.resume(run_id)
            self.env.run_until_idle()

    @invariant()
    def the_limit_holds_and_no_slot_idles_while_runs_queue(self) -> None:
        rows = self.env.conn.execute(
            "SELECT concurrency_key AS k, state, queued, created_at, id FROM cyclone_runs"
            " ORDER BY created_at, id"
        ).fetchall()
        for key in ("A", "B"):
            mine = [r for r in rows if r["k"] == key]
            active = [r for r in mine if r["state"] in ("running", "paused") and not r["queued"]]
            queued = [r for r in mine if r["state"] == "queued"]
            assert len(active) <= 2, (key, mine)
            assert not queued or len(active) == 2, (key, mine)


@pytest.mark.property
def test_keyed_runs_keep_their_limit_whatever_happens(env: TestEnv) -> None:
    env.register(*ALL)
    KeyedRuns.env = env
    run_state_machine_as_test(KeyedRuns, settings=settings(
        max_examples=25, stateful_step_count=15, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    ))  # fmt: skip


def test_cyclone_limits_and_runs_state_queued_show_the_queue(
    env: TestEnv, capsys: pytest.CaptureFixture[str]
):
    from cli_support import run_cli

    env.register(*ALL)
    runs = env.client.submit_many(sync, [{"account": "acct-7"}] * 3)
    env.run_until_idle()
    r = run_cli(capsys, env, "limits", "--json")
    assert r.code == 0
    doc = json.loads(r.out)
    assert doc["keys"] == [
        {"workflow": sync.name, "key": "acct-7", "limit": 1, "active": 1, "queued": 2}
    ]
    r = run_cli(capsys, env, "limits")
    assert r.code == 0 and "acct-7" in r.out and "Runs per key" in r.out
    r = run_cli(capsys, env, "runs", "--state", "queued", "--json")
    assert r.code == 0
    assert sorted(row["id"] for row in json.loads(r.out)) == sorted(runs[1:])


def test_a_child_run_counts_against_its_workflows_limit_and_a_keyless_input_fails_the_node(
    env: TestEnv,
):
    env.register(*ALL)
    direct = env.client.submit(sync, {"account": "A"})
    via_parent = env.client.submit(parent, {"account": "A"})
    env.run_until_idle()
    [child] = [s.id for s in env.client.steps(via_parent) if s.node == "kid"]
    child_run = env.conn.execute(
        "SELECT child_run_id::text AS id FROM cyclone_steps WHERE id = %s", (child,)
    ).fetchone()["id"]
    assert states(env, [direct, child_run]) == ["running", "queued"]
    finish(env, direct)
    assert states(env, [child_run]) == ["running"]
    keyless = env.client.submit(parent, {"no": "key"})
    status = env.run_until_complete(keyless)
    assert status.state == RunState.FAILED
    assert "the input has no field 'account'" in (status.error or "")


roomy = cyclone.Workflow("ck-roomy", concurrency=cyclone.Concurrency(key="account", limit=100))


@roomy.task()
def once(ctx):
    return None


def _key_lock(env: TestEnv, key: str) -> tuple[int, int]:
    """The advisory lock of roomy's `key` (cyclone_slot_lock), as pg_locks shows it."""
    row = env.conn.execute(
        "SELECT (k >> 32)::int AS hi, (k & 4294967295)::bigint AS lo FROM (SELECT"
        " hashtextextended('cyclone_slot:' || current_schema() || chr(31) || %s || chr(31)"
        " || %s, 0) AS k) AS h",
        (roomy.name, key),
    ).fetchone()
    return int(row["hi"]) & 0xFFFFFFFF, int(row["lo"])


def test_the_supervisors_statement_takes_the_keys_of_the_runs_it_ends_in_one_order(
    env: TestEnv,
):
    """Runs of keys b and a end in one steps_dispatch, b's run first (in id order and among
    its completions): the statement takes a's lock, then b's, before either run ends (as
    submits take them), so two such statements cannot deadlock. Taken as each run ended, b's
    came first: with a held elsewhere, the statement held b while it waited for a, as another
    that held a could wait for b (drains of 100 keys on 8 workers met about one a second)."""
    import threading

    from cyclone.db import connect
    from cyclone.engine.dispatch import Finished, dispatch

    env.register(roomy)
    while True:  # b's run first in id order
        b_run, a_run = env.client.submit_many(roomy, [{"account": "b"}, {"account": "a"}])
        if b_run < a_run:
            break
        env.client.cancel(b_run)
        env.client.cancel(a_run)
    leases = dispatch(env.conn, [], ["w1", "w2", "w3", "w4"], workflows=[roomy.name]).leases
    mine = [r for r in leases.values() if r["run_id"] in (a_run, b_run)]
    assert len(mine) == 2
    mine.sort(key=lambda r: r["run_id"] != b_run)  # b's first, in every order the statement has
    finished = [Finished(r["id"], r["lease_token"], r["run_id"], None, last=True) for r in mine]
    pid: list[int] = []
    with connect(env.dsn) as other, other.transaction():
        other.execute("SELECT cyclone_slot_lock(%s, 'a')", (roomy.name,))

        def end() -> None:
            with connect(env.dsn) as conn:
                pid.append(conn.execute("SELECT pg_backend_pid() AS p").fetchone()["p"])
                dispatch(conn, finished, [], workflows=[roomy.name])

        thread = threading.Thread(target=end)
        thread.start()
        held: set[tuple[int, int]] = set()
        for _ in range(200):  # until the statement waits for a's lock
            rows = env.conn.execute(
                "SELECT classid, objid, granted FROM pg_locks WHERE locktype = 'advisory'"
                " AND pid = %s", (pid[0] if pid else 0,)
            ).fetchall()
            if any(not r["granted"] for r in rows):
                held = {(int(r["classid"]), int(r["objid"])) for r in rows if r["granted"]}
                break
            threading.Event().wait(0.02)
        else:
            raise AssertionError("the statement never waited for key a's lock")
        assert _key_lock(env, "b") not in held
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert {env.client.get_run(r).state for r in (a_run, b_run)} == {RunState.COMPLETED}

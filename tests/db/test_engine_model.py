"""A model-based test of the engine: random operations, invariants read from the SQL tables.

A hypothesis state machine drives the real engine functions (submit, lease, heartbeat,
complete, fail, cancel, pause, resume, signal, every scanner sweep) on a real PostgreSQL with
the TestEnv clock, and after every operation checks the promises of docs/api.md (states,
errors) and docs/run-deadlines.md against `cyclone_runs` and `cyclone_steps`.
"""

from __future__ import annotations

import os
import warnings
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
)

import cyclone
from cyclone import engine
from cyclone.engine.steps import Lease
from cyclone.errors import UnheardSignal
from cyclone.states import DEADLINE_ERROR, ErrorKind, NodeKind
from cyclone.testing import TestEnv

pytestmark = pytest.mark.property

# -- workflows -------------------------------------------------------------------------------
# Their handlers never run: the machine plays the worker and records outcomes itself.

chain = cyclone.Workflow("model-chain")


@chain.task(max_attempts=3)
def first(ctx: cyclone.StepContext) -> int:
    return 1


@chain.task(after=[first], max_attempts=3)
def second(ctx: cyclone.StepContext) -> int:
    return 2


gated = cyclone.Workflow("model-wait")


@gated.task(max_attempts=3)
def prep(ctx: cyclone.StepContext) -> int:
    return 1


gated.wait("approval", signal="approved", after=[prep], max_wait=timedelta(minutes=10))


@gated.task(after=["approval"], max_attempts=2)
def finish(ctx: cyclone.StepContext) -> int:
    return 3


napping = cyclone.Workflow("model-sleep")


@napping.task(max_attempts=2)
def before(ctx: cyclone.StepContext) -> int:
    return 1


napping.sleep("nap", timedelta(minutes=5), after=[before])


@napping.task(after=["nap"], max_attempts=3)
def after(ctx: cyclone.StepContext) -> int:
    return 4


kid = cyclone.Workflow("model-kid")


@kid.task(max_attempts=2)
def chore(ctx: cyclone.StepContext) -> int:
    return 5


family = cyclone.Workflow("model-parent")
family.child("sub", kid, max_wait=timedelta(minutes=10))


@family.task(after=["sub"], max_attempts=2)
def wrap(ctx: cyclone.StepContext) -> int:
    return 6


WORKFLOWS = (chain, gated, napping, family)
CHILD_MAX_WAIT = 600.0
SINKS = {wf.name: set(wf.graph.sinks) for wf in (*WORKFLOWS, kid)}
# How long each parked node's time gate (due_at) runs from the moment the node parks.
GATE_LENGTH = {
    (wf.name, spec.name): timedelta(seconds=spec.duration or spec.max_wait or 0)
    for wf in WORKFLOWS
    for spec in wf.graph.nodes.values()
    if spec.kind in (NodeKind.WAIT, NodeKind.SLEEP, NodeKind.CHILD)
}

LIVE_STEPS = frozenset({"available", "running", "waiting"})
TERMINAL_STEPS = frozenset({"completed", "dead", "discarded"})
LIVE_RUNS = frozenset({"running", "paused"})
TERMINAL_RUNS = frozenset({"completed", "failed", "cancelled"})
MAX_RUNS = 4

STEPS_SQL = "SELECT * FROM cyclone_steps ORDER BY id"
RUNS_SQL = "SELECT * FROM cyclone_runs ORDER BY id"
SIGNALS_SQL = "SELECT * FROM cyclone_signals ORDER BY id"
# What each sweep of runs and steps handles, as it stands overdue at %(now)s.
LEFTOVERS = {
    "deadlines": """
        SELECT id FROM cyclone_runs
         WHERE state = 'running' AND deadline_at <= %(now)s""",
    "expired_leases": """
        SELECT id FROM cyclone_steps
         WHERE state = 'running' AND lease_expires_at < %(now)s""",
    "max_wait": """
        SELECT s.id FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id
         WHERE r.state = 'running' AND s.state = 'waiting'
           AND s.kind IN ('wait', 'child') AND s.due_at <= %(now)s""",
    "sleeps": """
        SELECT s.id FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id
         WHERE r.state = 'running' AND s.state = 'waiting' AND s.kind = 'sleep'
           AND s.due_at <= %(now)s""",
}
# The scanner's sweeps of runs and steps, in its order (not presence rows: the model has none).
SWEPT = [s for s in engine.enabled_sweeps() if s.name in LEFTOVERS]

deadlines = st.one_of(
    st.none(),
    st.sampled_from([0, timedelta(0)]),  # both mean "no deadline" (a negative one is refused)
    st.sampled_from([90, 400, 900.5]),
    st.builds(timedelta, seconds=st.integers(min_value=1, max_value=1800)),
)
ttls = st.sampled_from([30.0, 60.0, 600.0])
time_steps = st.one_of(
    st.sampled_from([31, 61, 301, 601, 1800]),
    st.integers(min_value=0, max_value=900),
)


class EngineModel(RuleBasedStateMachine):
    """One TestEnv (its own schema) per example; the model keeps what it must compare."""

    runs = Bundle("runs")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.env: TestEnv | None = None
        self.run_count = 0
        # What the invariants saw last time, to prove states only move forward.
        self.seen_steps: dict[int, dict[str, Any]] = {}
        self.seen_runs: dict[str, dict[str, Any]] = {}
        # Per paused run: when it paused, its deadline then, and its retry gates then.
        self.pauses: dict[str, dict[str, Any]] = {}
        self.tokens_issued: dict[int, list[str]] = {}

    # -- helpers ---------------------------------------------------------------------------------

    def now(self) -> datetime:
        assert self.env is not None
        return self.env.now()

    @property
    def conn(self) -> Any:
        assert self.env is not None
        return self.env.conn

    def step_row(self, step_id: int) -> dict[str, Any]:
        row = self.conn.execute("SELECT * FROM cyclone_steps WHERE id = %s", [step_id]).fetchone()
        assert row is not None, f"step {step_id} vanished"
        return row

    def run_row(self, run_id: str) -> dict[str, Any]:
        row = self.conn.execute("SELECT * FROM cyclone_runs WHERE id = %s", [run_id]).fetchone()
        assert row is not None, f"run {run_id} vanished"
        return row

    def snapshot(self) -> tuple[list[Any], list[Any], list[Any]]:
        return (
            self.conn.execute(STEPS_SQL).fetchall(),
            self.conn.execute(RUNS_SQL).fetchall(),
            self.conn.execute(SIGNALS_SQL).fetchall(),
        )

    def holds(self, lease: Lease) -> bool:
        """Whether this lease is still the step's valid lease."""
        row = self.step_row(lease.step_id)
        return row["state"] == "running" and str(row["lease_token"]) == lease.token

    def assert_stale_write_changes_nothing(self, lease: Lease, write: Any) -> None:
        event(f"stale {write.__qualname__.split('.')[1]}")
        before = self.snapshot()
        assert write() is False, "a write under a stale lease token was accepted"
        assert self.snapshot() == before, "a write under a stale lease token changed a row"

    # -- lifecycle -------------------------------------------------------------------------------

    @initialize(target=runs, wf=st.sampled_from(WORKFLOWS), run_deadline=deadlines)
    def open_env_and_submit(self, wf: cyclone.Workflow, run_deadline: Any) -> Any:
        self.env = TestEnv(workflows=WORKFLOWS)
        return self.submit(wf, run_deadline)

    def teardown(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    # -- rules: submitting and leasing -----------------------------------------------------------

    @rule(target=runs, wf=st.sampled_from(WORKFLOWS), run_deadline=deadlines)
    def submit(self, wf: cyclone.Workflow, run_deadline: Any) -> Any:
        if self.run_count >= MAX_RUNS:
            return multiple()
        assert self.env is not None
        run_id = self.env.client.submit(wf, {"n": self.run_count}, run_deadline=run_deadline)
        self.run_count += 1
        row = self.run_row(run_id)
        assert row["state"] == "running"
        secs = (
            run_deadline.total_seconds()
            if isinstance(run_deadline, timedelta)
            else (run_deadline or 0)
        )
        if secs > 0:
            assert row["deadline_at"] - row["created_at"] == timedelta(seconds=secs)
        else:
            assert row["deadline_at"] is None
        return run_id

    @rule(target=leases, ttl=ttls)
    def lease(self, ttl: float) -> Any:
        now = self.now()
        before = {r["id"]: r for r in self.conn.execute(STEPS_SQL).fetchall()}
        lease = engine.lease_step(self.conn, worker="model", lease_ttl=ttl, now=now)
        if lease is None:
            # Nothing was due: no available step of a running run, due now, within its deadline.
            due = self.conn.execute(
                """SELECT s.id FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id
                    WHERE s.state = 'available' AND s.available_at <= %(now)s
                      AND r.state = 'running'
                      AND (r.deadline_at IS NULL OR r.deadline_at > %(now)s)""",
                {"now": now},
            ).fetchall()
            assert due == [], f"lease_step found nothing although {due} were due"
            return multiple()
        old = before[lease.step_id]
        row = self.step_row(lease.step_id)
        run = self.run_row(lease.run_id)
        assert old["state"] == "available" and old["available_at"] <= now
        assert run["state"] == "running", "a step of a run that is not running was leased"
        assert run["deadline_at"] is None or run["deadline_at"] > now, "leased past the deadline"
        assert row["state"] == "running" and str(row["lease_token"]) == lease.token
        assert row["attempt"] == old["attempt"] + 1 == lease.attempt
        assert lease.attempt <= lease.max_attempts
        assert row["lease_expires_at"] == now + timedelta(seconds=ttl)
        assert lease.token not in self.tokens_issued.get(lease.step_id, [])
        self.tokens_issued.setdefault(lease.step_id, []).append(lease.token)
        return lease

    @rule(target=runs, ttl=ttls, steps=st.integers(min_value=1, max_value=3))
    def work(self, ttl: float, steps: int) -> Any:
        """A healthy worker: lease the next due steps and complete each at once."""
        children = []
        for _ in range(steps):
            lease = self.lease(ttl)
            if not isinstance(lease, Lease):
                break
            children.extend(self.complete(lease).values)
        return multiple(*children)

    @rule(lease=leases, ttl=ttls)
    def heartbeat(self, lease: Lease, ttl: float) -> None:
        now = self.now()

        def write() -> bool:
            return engine.heartbeat(self.conn, lease.step_id, lease.token, lease_ttl=ttl, now=now)

        if not self.holds(lease):
            self.assert_stale_write_changes_nothing(lease, write)
            return
        assert write() is True
        assert self.step_row(lease.step_id)["lease_expires_at"] == now + timedelta(seconds=ttl)

    @rule(target=runs, lease=leases)
    def complete(self, lease: Lease) -> Any:
        """Record the attempt's result; a child node's result is its child run, started."""
        now = self.now()
        started: list[str] = []

        def write() -> bool:
            if lease.kind == NodeKind.CHILD:
                child_id = engine.start_child(
                    self.conn,
                    lease,
                    kid.name,
                    {"parent": lease.run_id},
                    max_wait=CHILD_MAX_WAIT,
                    now=now,
                )
                started.extend([child_id] if child_id else [])
                return child_id is not None
            return engine.complete_step(self.conn, lease, {"node": lease.node}, now=now)

        if not self.holds(lease):
            self.assert_stale_write_changes_nothing(lease, write)
            return multiple()
        assert write() is True
        row = self.step_row(lease.step_id)
        if lease.kind == NodeKind.CHILD:
            (child_id,) = started
            assert row["state"] == "waiting" and row["lease_token"] is None
            assert str(row["child_run_id"]) == child_id
            assert row["due_at"] == now + timedelta(seconds=CHILD_MAX_WAIT)
            child = self.run_row(child_id)
            assert child["state"] == "running" and child["deadline_at"] is None
            assert str(child["parent_run_id"]) == lease.run_id
            event("started a child run")
            return multiple(child_id)
        assert row["state"] == "completed" and row["lease_token"] is None
        assert row["output"] == {"node": lease.node}
        return multiple()

    @rule(
        lease=leases,
        kind=st.sampled_from([ErrorKind.ERROR, ErrorKind.TIMEOUT, ErrorKind.CRASHED]),
        permanent=st.booleans(),
    )
    def fail(self, lease: Lease, kind: ErrorKind, permanent: bool) -> None:
        now = self.now()
        retry = False if permanent else None

        def write() -> bool:
            return engine.fail_step(
                self.conn,
                lease.step_id,
                lease.token,
                kind=kind,
                error="boom",
                retry=retry,
                now=now,
            )

        if not self.holds(lease):
            self.assert_stale_write_changes_nothing(lease, write)
            return
        run_before = self.run_row(lease.run_id)["state"]
        assert write() is True
        row = self.step_row(lease.step_id)
        assert row["error_kind"] == kind and row["error"] == "boom"
        assert row["lease_token"] is None
        if not permanent and row["attempt"] < row["max_attempts"]:
            assert row["state"] == "available"
            assert row["available_at"] > now, "a retry came back without a backoff"
        else:
            assert row["state"] == "dead"
            assert run_before in LIVE_RUNS
            assert self.run_row(lease.run_id)["state"] == "failed", "a dead step left its run live"

    # -- rules: controlling runs -----------------------------------------------------------------

    @rule(run_id=runs)
    def cancel(self, run_id: str) -> None:
        now = self.now()
        before = self.run_row(run_id)["state"]
        changed = engine.cancel_run(self.conn, run_id, now=now)
        assert changed == (before in LIVE_RUNS)
        after_state = self.run_row(run_id)["state"]
        assert after_state == ("cancelled" if changed else before)
        if changed:
            live = self.conn.execute(
                "SELECT id FROM cyclone_steps WHERE run_id = %s AND state <> ALL(%s)",
                [run_id, list(TERMINAL_STEPS)],
            ).fetchall()
            assert live == []

    @rule(run_id=runs)
    def pause(self, run_id: str) -> None:
        now = self.now()
        before = self.run_row(run_id)
        changed = engine.pause_run(self.conn, run_id, now=now)
        assert changed == (before["state"] == "running")
        row = self.run_row(run_id)
        if not changed:
            assert row == before, "a pause that changed nothing changed the run"
            return
        assert row["state"] == "paused" and row["paused_at"] == now
        assert row["deadline_at"] == before["deadline_at"]
        retry_gates = {
            r["id"]: r["available_at"]
            for r in self.conn.execute(
                """SELECT id, available_at FROM cyclone_steps
                    WHERE run_id = %s AND state = 'available' AND attempt > 0
                      AND available_at > %s""",
                [run_id, now],
            ).fetchall()
        }
        self.pauses[run_id] = {"at": now, "deadline_at": row["deadline_at"], "retry": retry_gates}

    @rule(run_id=runs)
    def resume(self, run_id: str) -> None:
        now = self.now()
        before = self.run_row(run_id)
        gates = {
            r["id"]: r
            for r in self.conn.execute(
                "SELECT * FROM cyclone_steps WHERE run_id = %s", [run_id]
            ).fetchall()
        }
        changed = engine.resume_run(self.conn, run_id, now=now)
        assert changed == (before["state"] == "paused")
        row = self.run_row(run_id)
        if not changed:
            assert row == before, "a resume that changed nothing changed the run"
            return
        pause = self.pauses.pop(run_id)
        paused_at: datetime = before["paused_at"]
        assert paused_at == pause["at"]
        assert row["state"] == "running" and row["paused_at"] is None
        # The run keeps the time it had left when it paused, to the microsecond.
        assert before["deadline_at"] == pause["deadline_at"], "the deadline moved while paused"
        if before["deadline_at"] is None:
            assert row["deadline_at"] is None
        else:
            event("resumed a run with a deadline")
            assert row["deadline_at"] - now == before["deadline_at"] - paused_at
        # Its other time gates keep their time left too.
        for step_id, old in gates.items():
            new = self.step_row(step_id)
            if old["state"] == "waiting" and old["due_at"] is not None:
                # The gate started when the node parked, or stopped when the run paused.
                parked = old["due_at"] - GATE_LENGTH[old["workflow"], old["node"]]
                stopped = max(paused_at, parked)
                assert new["due_at"] - now == old["due_at"] - stopped, (
                    f"step {old['node']} did not keep its time left across the pause"
                )
            was = pause["retry"].get(step_id)
            if (
                was is not None
                and old["state"] == "available"
                and old["available_at"] == was
                and old["attempt"] > 0
            ):
                assert new["available_at"] - now == was - paused_at, (
                    f"retry of {old['node']} did not keep its backoff across the pause"
                )

    @rule(run_id=runs, name=st.sampled_from(["approved", "approved", "unrelated"]))
    def signal(self, run_id: str, name: str) -> None:
        now = self.now()
        before = self.run_row(run_id)["state"]
        waiting = self.conn.execute(
            """SELECT id FROM cyclone_steps WHERE run_id = %s AND kind = 'wait'
                AND signal = %s AND state = 'waiting'""",
            [run_id, name],
        ).fetchone()
        # A name no wait node of the run's graph listens for is kept, with a warning (issue 27,
        # item 3): the model checks that it is kept, not how it is said.
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", UnheardSignal)
            delivered = engine.signal_run(self.conn, run_id, name, {"by": "model"}, now=now)
        assert delivered == (before in LIVE_RUNS)
        heard = {
            n.signal for n in engine.graph_by_hash(self.conn, self.run_row(run_id)["graph_hash"])
            .nodes.values() if n.signal
        }  # fmt: skip
        assert bool(said) == (delivered and waiting is None and name not in heard)
        if delivered and waiting is not None:
            row = self.step_row(waiting["id"])
            assert row["state"] == "completed" and row["output"] == {"by": "model"}

    # -- rules: time and the scanner -------------------------------------------------------------

    @rule(seconds=time_steps, then_scan=st.booleans())
    def advance(self, seconds: int, then_scan: bool) -> None:
        assert self.env is not None
        self.env.advance_time(timedelta(seconds=seconds))
        if then_scan:
            self.scan()

    @rule(sweep=st.sampled_from(SWEPT), batch_size=st.sampled_from([1, 2, 500]))
    def sweep(self, sweep: Any, batch_size: int) -> None:
        """A scanner pass: the sweep in batches until a batch changes nothing."""
        now = self.now()
        for _ in range(50):
            if not sweep.batch(self.conn, batch_size=batch_size, now=now):
                break
            event(f"{sweep.name} changed rows")
        self.check_swept(sweep, now)

    @rule()
    def scan(self) -> None:
        for sweep in SWEPT:
            now = self.now()
            if sweep.batch(self.conn, now=now):
                event(f"{sweep.name} changed rows")
            self.check_swept(sweep, now)

    def check_swept(self, sweep: Any, now: datetime) -> None:
        """After a sweep at `now`, nothing it handles is still overdue at `now`."""
        leftovers = LEFTOVERS[sweep.name]
        rows = self.conn.execute(leftovers, {"now": now}).fetchall()
        assert rows == [], f"{sweep.name} at {now} left {rows} overdue"

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def tables_agree_with_the_contract(self) -> None:
        if self.env is None:
            return
        steps = self.conn.execute(STEPS_SQL).fetchall()
        runs = {str(r["id"]): r for r in self.conn.execute(RUNS_SQL).fetchall()}
        by_run: dict[str, list[dict[str, Any]]] = {rid: [] for rid in runs}
        step_ids = set()

        for s in steps:
            step_ids.add(s["id"])
            by_run[str(s["run_id"])].append(s)
            # At most one valid lease per step: running <=> a lease token, and the token is
            # the one (and only one) of those issued that still matches.
            assert (s["state"] == "running") == (s["lease_token"] is not None)
            issued = self.tokens_issued.get(s["id"], [])
            valid = [
                t for t in issued if s["lease_token"] is not None and t == str(s["lease_token"])
            ]
            assert len(valid) <= 1
            if s["state"] == "running":
                assert valid, "a running step holds a lease nobody was given"
                assert valid[0] == issued[-1], "an older lease is valid again"
            assert 0 <= s["attempt"] <= s["max_attempts"]
            if s["state"] == "dead" and s["error_kind"] == "deadline":
                assert s["error"] == DEADLINE_ERROR

            seen = self.seen_steps.get(s["id"])
            if seen is not None:
                assert s["attempt"] >= seen["attempt"], f"attempts of {s['node']} went down"
                if seen["state"] in TERMINAL_STEPS:
                    assert s == seen, f"terminal step {s['node']} ({seen['state']}) changed"
            self.seen_steps[s["id"]] = s

        lost = set(self.seen_steps) - step_ids
        assert not lost, f"steps {lost} vanished"

        for run_id, run in runs.items():
            states = [s["state"] for s in by_run[run_id]]
            live = [st_ for st_ in states if st_ in LIVE_STEPS]
            dead = [s for s in by_run[run_id] if s["state"] == "dead"]
            state = run["state"]
            # Every workflow here is a chain: one live step at a time, never two.
            assert len(live) <= 1, f"{state} run with live steps {states}"
            if state == "completed":
                assert states and all(x == "completed" for x in states), states
                sinks = SINKS[run["workflow"]]
                assert set(run["output"]) == sinks, "the run output is not its sinks' outputs"
            elif state == "failed":
                assert dead and not live, f"failed run with steps {states}"
            elif state == "cancelled":
                assert not live, f"cancelled run with steps {states}"
            else:
                assert live, f"{state} run with no live step: {states}"

            deadline_deaths = [s for s in dead if s["error_kind"] == "deadline"]
            if deadline_deaths:
                assert state == "failed"
                assert run["deadline_at"] is not None
                assert run["deadline_at"] <= run["finished_at"], "failed before its deadline"
                assert deadline_deaths == dead, "a deadline failure mixed with another"

            seen = self.seen_runs.get(run_id)
            if seen is not None:
                if seen["state"] != state:
                    event(f"run {seen['state']} -> {state}")
                if seen["state"] in TERMINAL_RUNS:
                    assert run == seen, f"terminal run ({seen['state']}) changed"
                if seen["state"] == "paused" and state == "failed":
                    assert not deadline_deaths, "a paused run's deadline fired"
                if seen["state"] == "paused" and state == "paused":
                    assert run["deadline_at"] == seen["deadline_at"]
            self.seen_runs[run_id] = run

        # A child run and its parent's child node end together.
        nodes = {s["child_run_id"]: s for s in steps if s["child_run_id"] is not None}
        for run in runs.values():
            if run["parent_run_id"] is None:
                continue
            assert run["deadline_at"] is None, "a child run has a deadline of its own"
            node = nodes[run["id"]]
            parent = runs[str(run["parent_run_id"])]
            where = f"child run {run['state']}, its node {node['state']}, parent {parent['state']}"
            if run["state"] in LIVE_RUNS:
                assert node["state"] == "waiting" and parent["state"] in LIVE_RUNS, where
            elif run["state"] == "completed":
                assert node["state"] == "completed", where
            else:
                assert node["state"] in ("dead", "discarded"), where
                assert parent["state"] in TERMINAL_RUNS, where
            if parent["state"] in TERMINAL_RUNS or node["state"] in TERMINAL_STEPS:
                assert run["state"] in TERMINAL_RUNS, where
            if node["error_kind"] == "child_failed":
                assert run["state"] in ("failed", "cancelled"), where

        # No signal is lost: none is kept while the wait it is for is parked.
        lost_signals = self.conn.execute(
            """SELECT g.name, s.id FROM cyclone_signals g
                 JOIN cyclone_steps s ON s.run_id = g.run_id AND s.kind = 'wait'
                  AND s.signal = g.name AND s.state = 'waiting'
                WHERE g.consumed_by IS NULL"""
        ).fetchall()
        assert lost_signals == [], f"signals kept while their wait is parked: {lost_signals}"

        lost_runs = set(self.seen_runs) - set(runs)
        assert not lost_runs, f"runs {lost_runs} vanished"


# How hard the machine tries, by CYCLONE_MODEL (CI=true implies "ci"):
# - "ci": a fixed set of examples, the same on every run (derandomize): CI goes red for a fault
#   of the code, never for luck, and a fault it caught once it catches every time;
# - "dev" (the default): fewer, new on each run, so that local runs explore;
# - "long": many, random, for a nightly run; `pytest --hypothesis-seed N` replays one.
# CYCLONE_MODEL_EXAMPLES overrides the count of any of them.
MODEL_PROFILES: dict[str, dict[str, Any]] = {
    "ci": {"max_examples": 80, "derandomize": True},
    "dev": {"max_examples": 25},
    "long": {"max_examples": 1000},
}


def model_profile() -> dict[str, Any]:
    name = os.environ.get("CYCLONE_MODEL") or ("ci" if os.environ.get("CI") else "dev")
    if name not in MODEL_PROFILES:
        raise ValueError(f"CYCLONE_MODEL={name!r}: one of {', '.join(MODEL_PROFILES)}")
    profile = dict(MODEL_PROFILES[name])
    if os.environ.get("CYCLONE_MODEL_EXAMPLES"):
        profile["max_examples"] = int(os.environ["CYCLONE_MODEL_EXAMPLES"])
    return profile


EngineModel.TestCase.settings = settings(
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    **model_profile(),
)
TestRandomOperationsKeepEveryEngineInvariant = EngineModel.TestCase


# -- minimal reproductions of what the machine (and its neighbours) found -----------------------


def scalar(env: TestEnv, sql: str) -> Any:
    (value,) = env.conn.execute(sql).fetchone().values()
    return value


def test_a_child_node_parked_during_a_pause_keeps_its_max_wait() -> None:
    with TestEnv(workflows=WORKFLOWS) as env:
        run_id = env.client.submit(family, {})
        lease = engine.lease_step(env.conn, worker="w", now=env.now())
        assert lease is not None and lease.node == "sub"
        env.advance_time(10)
        engine.pause_run(env.conn, run_id, now=env.now())
        env.advance_time(timedelta(hours=1))  # the child's input takes long to evaluate
        assert engine.start_child(
            env.conn, lease, kid.name, {}, max_wait=CHILD_MAX_WAIT, now=env.now()
        )
        env.advance_time(60)
        resumed = env.now()
        assert engine.resume_run(env.conn, run_id, now=resumed)
        due = scalar(env, "SELECT due_at FROM cyclone_steps WHERE node = 'sub'")
        # Parked during the pause: its whole max_wait is still ahead of it at resume.
        assert due - resumed == timedelta(seconds=CHILD_MAX_WAIT)


def test_a_retry_scheduled_during_a_pause_keeps_its_backoff() -> None:
    with TestEnv(workflows=WORKFLOWS) as env:
        run_id = env.client.submit(chain, {})
        lease = engine.lease_step(env.conn, worker="w", now=env.now())
        assert lease is not None
        engine.pause_run(env.conn, run_id, now=env.now())
        env.advance_time(timedelta(minutes=30))  # the attempt runs on, then fails
        failed = env.now()
        assert engine.fail_step(
            env.conn, lease.step_id, lease.token, kind="error", error="boom", now=failed
        )
        available = scalar(env, "SELECT available_at FROM cyclone_steps")
        backoff = available - failed
        assert timedelta(0) < backoff <= timedelta(seconds=1)
        env.advance_time(60)
        resumed = env.now()
        assert engine.resume_run(env.conn, run_id, now=resumed)
        moved = scalar(env, "SELECT available_at FROM cyclone_steps")
        assert moved - resumed == backoff, "the retry waits out part of the pause again"


@pytest.mark.parametrize("sweep", ["sweep_max_wait", "sweep_sleeps"])
def test_overdue_gates_of_paused_runs_do_not_starve_a_sweep(sweep: str) -> None:
    gate = cyclone.Workflow(f"model-starve-{sweep}")
    if sweep == "sweep_max_wait":
        gate.wait("approval", max_wait=timedelta(minutes=10))
    else:
        gate.sleep("nap", timedelta(minutes=10))
    with TestEnv(workflows=[gate]) as env:
        paused = env.client.submit(gate, {})  # its gate is due first
        env.advance_time(1)
        running = env.client.submit(gate, {})
        assert engine.pause_run(env.conn, paused, now=env.now())
        env.advance_time(timedelta(hours=1))
        for _ in range(3):  # a scanner looping with a small batch
            getattr(engine, sweep)(env.conn, batch_size=1, now=env.now())
        assert env.client.get_run(paused).state == "paused"
        assert env.client.get_run(running).state != "running", "the running run's gate starved"

"""Each sweep, called once with a fixed `now` on seeded rows; the loop they share; and the
registry that declares them (cyclone/engine/sweeps.py), which the scanner and TestEnv share."""

from __future__ import annotations

import dataclasses
import os
import re
from datetime import timedelta
from types import SimpleNamespace

import pytest

import cyclone
from cyclone import engine
from cyclone.engine.sweeps import Sweep
from cyclone.scanner import Scanner, ScannerOptions, make_sweeps
from cyclone.scanner.base import Sweeper
from cyclone.sql import QUERIES
from cyclone.states import DEADLINE_ERROR, ErrorKind, RunState, StepState
from cyclone.supervisor.metrics import Metrics

tasks = cyclone.Workflow("sweep-task")


@tasks.task(max_attempts=2)
def one(ctx):
    return 1


waits = cyclone.Workflow("sweep-wait")
waits.wait("approval", signal="approved", max_wait=timedelta(minutes=5))

twin_waits = cyclone.Workflow("sweep-twin-waits")
twin_waits.wait("legal", max_wait=timedelta(minutes=5))
twin_waits.wait("finance", max_wait=timedelta(minutes=5))

sleeps = cyclone.Workflow("sweep-sleep")
sleeps.sleep("nap", timedelta(minutes=5))

parents = cyclone.Workflow("sweep-parent")
parents.child("sub", tasks, after=[parents.task(one, name="first")])


@pytest.fixture
def env(env):
    env.register(tasks, waits, sleeps, parents, twin_waits)
    return env


def sweeper(name: str, **settings: float) -> Sweeper:
    """The registered sweep `name` as the scanner runs it, batches of 10."""
    (sweep,) = [s for s in engine.SWEEPS if s.name == name]
    return Sweeper(sweep, batch_size=10, settings=settings)


def lease(env):
    found = engine.lease_step(env.conn, worker="test", lease_ttl=30, now=env.now())
    assert found is not None
    return found


def test_the_deadline_sweep_fails_overdue_runs_and_leaves_others(env) -> None:
    late = env.client.submit(tasks, {}, run_deadline=timedelta(minutes=1))
    fine = env.client.submit(tasks, {}, run_deadline=timedelta(hours=1))
    sweep = sweeper("deadlines")
    assert sweep.run_once(env.conn, now=env.now()) == 0
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=2)) == 1
    status = env.client.get_run(late)
    assert (status.state, status.error_kind, status.error) == (
        RunState.FAILED, ErrorKind.DEADLINE, DEADLINE_ERROR,
    )  # fmt: skip
    assert env.client.get_run(fine).state == RunState.RUNNING


def test_the_lease_sweep_reclaims_only_expired_leases(env) -> None:
    run_id = env.client.submit(tasks, {})
    lease(env)
    sweep = sweeper("expired_leases")
    assert sweep.run_once(env.conn, now=env.now() + timedelta(seconds=29)) == 0
    assert sweep.run_once(env.conn, now=env.now() + timedelta(seconds=31)) == 1
    (step,) = env.client.steps(run_id)
    assert (step.state, step.error_kind) == (StepState.AVAILABLE, ErrorKind.LEASE_EXPIRED)


@pytest.mark.parametrize(
    ("name", "workflow", "later"),
    [
        ("deadlines", tasks, timedelta(minutes=2)),
        ("expired_leases", tasks, timedelta(seconds=31)),
        ("max_wait", waits, timedelta(minutes=6)),
        ("sleeps", sleeps, timedelta(minutes=6)),
    ],
)  # fmt: skip
def test_a_sweep_takes_one_batch_of_its_due_rows_per_call(env, name, workflow, later) -> None:
    # The batch bounds each transaction (and its locks): the scanner loops for the rest.
    deadline = timedelta(minutes=1) if name == "deadlines" else None
    env.client.submit_many(workflow, [{}] * 3, run_deadline=deadline)
    if name == "expired_leases":
        for _ in range(3):
            lease(env)
    sweep = getattr(engine, f"sweep_{name}")
    now = env.now() + later
    assert [sweep(env.conn, batch_size=2, now=now) for _ in range(3)] == [2, 1, 0]


def test_the_max_wait_sweep_dead_letters_waits_parked_too_long(env) -> None:
    run_id = env.client.submit(waits, {})
    sweep = sweeper("max_wait")
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=4)) == 0
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=6)) == 1
    status = env.client.get_run(run_id)
    assert (status.state, status.error_kind) == (RunState.FAILED, ErrorKind.MAX_WAIT)


def test_the_sleep_sweep_wakes_sleeps_that_are_over(env) -> None:
    run_id = env.client.submit(sleeps, {})
    sweep = sweeper("sleeps")
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=4)) == 0
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=6)) == 1
    assert env.client.get_run(run_id).state == RunState.COMPLETED


def test_the_retention_sweep_deletes_only_old_finished_runs(env) -> None:
    done = env.client.submit(tasks, {})
    parent = env.client.submit(parents, {})
    running = env.client.submit(waits, {})
    env.run_until_complete(done)
    env.run_until_complete(parent)
    count = "SELECT count(*) AS n FROM cyclone_runs"
    assert env.conn.execute(count).fetchone()["n"] == 4  # with the parent's child run
    sweep = sweeper("retention", retention=3600)
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=30)) == 0
    assert sweep.run_once(env.conn, now=env.now() + timedelta(hours=2)) == 2
    for gone in (done, parent):
        with pytest.raises(cyclone.RunNotFound):
            env.client.get_run(gone)
    assert env.client.get_run(running).state == RunState.RUNNING
    # Every step went with its run, the child run's too: only the waiting run's step is left.
    steps = env.conn.execute("SELECT run_id::text AS run_id FROM cyclone_steps").fetchall()
    assert [s["run_id"] for s in steps] == [running]


def test_the_max_wait_sweep_counts_failed_runs_not_expired_waits(env) -> None:
    # It feeds cyclone_scanner_runs_failed_total{reason="max_wait"}.
    run_id = env.client.submit(twin_waits, {})
    sweep = sweeper("max_wait")
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=6)) == 1
    assert env.client.get_run(run_id).state == RunState.FAILED
    assert [s.state for s in env.client.steps(run_id)] == [StepState.DEAD, StepState.DEAD]


def counting(batch_size: int, results: list[int]) -> tuple[Sweeper, list[int]]:
    """A sweeper over a declared sweep whose batches change `results` rows in turn."""
    calls: list[int] = []

    def sweep_counting(conn, *, batch_size, now=None) -> int:
        calls.append(batch_size)
        return results.pop(0)

    return Sweeper(Sweep("counting", sweep_counting), batch_size=batch_size), calls


def test_a_sweep_batches_while_its_batches_come_back_full(caplog) -> None:
    pauses: list[float] = []
    sweep, calls = counting(2, [2, 2, 1, 2])
    with caplog.at_level("INFO"):
        assert sweep.run(None, pause=pauses.append) == 5
    assert calls == [2, 2, 2] and len(pauses) == 2
    assert all(0 < p < 1 for p in pauses)
    assert "counting: 5" in caplog.text


def test_a_sweep_that_changed_nothing_logs_nothing(caplog) -> None:
    with caplog.at_level("INFO"):
        assert counting(2, [0])[0].run(None, pause=lambda _: None) == 0
    assert caplog.text == ""


def test_a_sweep_of_one_batch_a_pass_that_logs_itself(caplog) -> None:
    sweep, calls = counting(1, [1, 1])
    sweep.sweep = dataclasses.replace(sweep.sweep, batches=1, logs_itself=True)
    with caplog.at_level("INFO"):
        assert sweep.run(None, pause=lambda _: None) == 1  # full, and yet once
    assert calls == [1] and caplog.text == ""
    (reindex,) = [s for s in engine.SWEEPS if s.name == "reindex"]
    assert reindex.batches == 1 and reindex.logs_itself and reindex.every


def test_deadlines_come_first_and_zero_retention_keeps_runs_forever() -> None:
    options = ScannerOptions(dsn="", interval=1, batch_size=10, retention=0)
    names = [s.name for s in make_sweeps(options)]
    assert names == [
        "deadlines", "queued_deadlines", "expired_leases", "max_wait", "sleeps",
        "stale_supervisors", "held_steps", "unserved", "fair_clock", "schedules", "reindex",
    ]  # fmt: skip
    kept = make_sweeps(ScannerOptions(dsn="", interval=1, batch_size=10, retention=60))
    assert kept[-2].name == "retention" and not kept[-2].due(kept[-2].last_run + 1)


# The labels of the sweeps' counts on the scanner's `scanned` pipe line and in its log lines:
# the supervisor's metrics and operators' log queries read them, so they never change.
LABELS = [
    "deadlines", "queued_deadlines", "expired_leases", "max_wait", "sleeps",
    "stale_supervisors", "held_steps", "unserved", "fair_clock", "schedules", "history",
    "history_drop", "retention", "reindex",
]  # fmt: skip


def test_every_sweep_has_one_name_for_its_label_statement_and_function() -> None:
    assert [s.name for s in engine.SWEEPS] == LABELS
    for sweep in engine.SWEEPS:
        assert re.fullmatch(r"[a-z][a-z_]*", sweep.name), sweep.name
        assert f"sweep_{sweep.name}" in QUERIES, f"no -- name: sweep_{sweep.name} block"
        assert sweep.run.__name__ == f"sweep_{sweep.name}"
        assert getattr(engine, f"sweep_{sweep.name}") is sweep.run
    # Nothing named like a sweep is left out of the registry.
    statements = {n.removeprefix("sweep_") for n in QUERIES if n.startswith("sweep_")}
    functions = {n.removeprefix("sweep_") for n in dir(engine) if n.startswith("sweep_")}
    assert statements == functions == set(LABELS)


def test_the_metrics_read_the_counts_the_registry_says_they_are() -> None:
    metrics = Metrics()
    failed = {s.name: s.runs_failed for s in engine.SWEEPS if s.runs_failed is not None}
    assert failed == {
        "deadlines": ErrorKind.DEADLINE, "queued_deadlines": ErrorKind.DEADLINE,
        "max_wait": ErrorKind.MAX_WAIT,
    }  # fmt: skip
    counts = dict.fromkeys(LABELS, 1)
    metrics.scanned(SimpleNamespace(at=1.0, ok=True, counts=counts))  # type: ignore[arg-type]
    registry = metrics.registry
    for reason in set(failed.values()):
        value = registry.get_sample_value("cyclone_scanner_runs_failed_total", {"reason": reason})
        assert value == sum(1 for r in failed.values() if r == reason), reason
    assert registry.get_sample_value("cyclone_lease_expirations_total") == 1.0


def test_the_scanner_and_testenv_run_the_same_sweeps_in_the_same_order(env, monkeypatch) -> None:
    ran: list[str] = []

    def recording(name: str):
        def run(conn, *, batch_size, now=None, **settings) -> int:
            ran.append(name)
            return 0

        return run

    fakes = tuple(dataclasses.replace(s, run=recording(s.name)) for s in engine.SWEEPS)
    monkeypatch.setattr(engine.sweeps, "SWEEPS", fakes)
    env.scan()
    by_env, ran[:] = list(ran), []
    options = ScannerOptions(dsn=env.dsn, interval=1, batch_size=10, retention=0)
    scanner = Scanner(options, parent=os.getpid())
    scanner.conn, scanner.wakeup = env.conn, SimpleNamespace(wait=lambda _: None)
    counts, ok = scanner.scan_once()
    # History and retention are off in both.
    on = [name for name in LABELS if name not in ("history", "history_drop", "retention")]
    assert ok and ran == by_env == on
    assert list(counts) == on and set(counts.values()) == {0}

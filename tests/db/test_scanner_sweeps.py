"""Each sweep, called once with a fixed `now` on seeded rows; and the loop they share."""

from __future__ import annotations

from datetime import timedelta

import pytest

import cyclone
from cyclone import engine
from cyclone.scanner import ScannerOptions, make_sweeps
from cyclone.scanner.base import Sweep
from cyclone.scanner.deadlines import DeadlineSweep
from cyclone.scanner.leases import ExpiredLeaseSweep
from cyclone.scanner.retention import RetentionSweep
from cyclone.scanner.sleeps import SleepSweep
from cyclone.scanner.waits import MaxWaitSweep
from cyclone.states import DEADLINE_ERROR, ErrorKind, RunState, StepState

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


def lease(env):
    found = engine.lease_step(env.conn, worker="test", lease_ttl=30, now=env.now())
    assert found is not None
    return found


def test_the_deadline_sweep_fails_overdue_runs_and_leaves_others(env) -> None:
    late = env.client.submit(tasks, {}, run_deadline=timedelta(minutes=1))
    fine = env.client.submit(tasks, {}, run_deadline=timedelta(hours=1))
    sweep = DeadlineSweep(batch_size=10)
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
    sweep = ExpiredLeaseSweep(batch_size=10)
    assert sweep.run_once(env.conn, now=env.now() + timedelta(seconds=29)) == 0
    assert sweep.run_once(env.conn, now=env.now() + timedelta(seconds=31)) == 1
    (step,) = env.client.steps(run_id)
    assert (step.state, step.error_kind) == (StepState.AVAILABLE, ErrorKind.LEASE_EXPIRED)


def test_the_max_wait_sweep_dead_letters_waits_parked_too_long(env) -> None:
    run_id = env.client.submit(waits, {})
    sweep = MaxWaitSweep(batch_size=10)
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=4)) == 0
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=6)) == 1
    status = env.client.get_run(run_id)
    assert (status.state, status.error_kind) == (RunState.FAILED, ErrorKind.MAX_WAIT)


def test_the_sleep_sweep_wakes_sleeps_that_are_over(env) -> None:
    run_id = env.client.submit(sleeps, {})
    sweep = SleepSweep(batch_size=10)
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
    sweep = RetentionSweep(batch_size=10, retention=3600)
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
    sweep = MaxWaitSweep(batch_size=10)
    assert sweep.run_once(env.conn, now=env.now() + timedelta(minutes=6)) == 1
    assert env.client.get_run(run_id).state == RunState.FAILED
    assert [s.state for s in env.client.steps(run_id)] == [StepState.DEAD, StepState.DEAD]


class Counting(Sweep):
    name = "counting"

    def __init__(self, batch_size: int, results: list[int]) -> None:
        super().__init__(batch_size=batch_size)
        self.results = results
        self.calls = 0

    def run_once(self, conn, now=None) -> int:
        self.calls += 1
        return self.results.pop(0)


def test_a_sweep_batches_while_its_batches_come_back_full(caplog) -> None:
    pauses: list[float] = []
    sweep = Counting(2, [2, 2, 1, 2])
    with caplog.at_level("INFO"):
        assert sweep.sweep(None, pause=pauses.append) == 5
    assert sweep.calls == 3 and len(pauses) == 2
    assert all(0 < p < 1 for p in pauses)
    assert "counting: 5" in caplog.text


def test_a_sweep_that_changed_nothing_logs_nothing(caplog) -> None:
    with caplog.at_level("INFO"):
        assert Counting(2, [0]).sweep(None, pause=lambda _: None) == 0
    assert caplog.text == ""


def test_deadlines_come_first_and_zero_retention_keeps_runs_forever() -> None:
    options = ScannerOptions(dsn="", interval=1, batch_size=10, retention=0)
    names = [s.name for s in make_sweeps(options)]
    assert names == ["deadlines", "expired_leases", "max_wait", "sleeps", "stale_supervisors"]
    kept = make_sweeps(ScannerOptions(dsn="", interval=1, batch_size=10, retention=60))
    assert kept[-1].name == "retention" and not kept[-1].due(kept[-1].last_run + 1)

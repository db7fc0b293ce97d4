"""A handler that ignores ctx.done and SIGTERM, and spawned a grandchild, dies all the same."""

from __future__ import annotations

from pathlib import Path

import pytest
from proc_helpers import alive, group_members, terminal, wait_for

from cyclone.states import DEADLINE_ERROR, ErrorKind, RunState, StepState

pytestmark = pytest.mark.process


def handler_pids(tmp: Path, run_id: str, attempt: int = 1) -> tuple[int, int]:
    note = tmp / f"{run_id}.{attempt}.pids"
    text = wait_for(lambda: note.exists() and note.read_text().strip(), 15, f"{note.name}")
    worker, grandchild = (int(x) for x in text.split())
    return worker, grandchild


def assert_group_gone(worker: int, grandchild: int, timeout: float) -> None:
    wait_for(lambda: not alive(worker) and not alive(grandchild), timeout, "the kill")
    assert group_members(worker) == []


def test_a_stubborn_handler_dies_at_its_runs_deadline_with_its_grandchild(
    env, supervisor, tmp_path
) -> None:
    from proc_flows import stubborn

    # No scanner: only the supervisor's own deadline timer (from the lease) can fail the run
    # and kill its worker here.
    sup = supervisor(scanner__enabled="false", wait=False)
    wait_for(lambda: len(sup.workers()) == 2, 15, f"2 workers\n{sup.log()}")
    run_id = env.client.submit(stubborn, {"dir": str(tmp_path)}, run_deadline=1.5)
    worker, grandchild = handler_pids(tmp_path, run_id)
    assert alive(grandchild)
    assert_group_gone(worker, grandchild, timeout=5)
    killed_at = env.conn.execute("SELECT now() AS now").fetchone()["now"]
    status = wait_for(lambda: terminal(env, run_id), 5, "the run to fail")
    # The supervisor knows the deadline from the lease: kill_grace (0.3 s) plus slack.
    assert (killed_at - status.deadline_at).total_seconds() < 1.0
    assert status.state == RunState.FAILED and status.error_kind == ErrorKind.DEADLINE
    (step,) = env.client.steps(run_id)
    assert (step.state, step.error_kind, step.error) == (
        StepState.DEAD, ErrorKind.DEADLINE, DEADLINE_ERROR,
    )  # fmt: skip
    replacement(sup, worker)
    assert sup.scanners() == []


def test_a_stubborn_handler_dies_when_its_run_is_cancelled(env, supervisor, tmp_path) -> None:
    from proc_flows import stubborn

    sup = supervisor()
    run_id = env.client.submit(stubborn, {"dir": str(tmp_path)})
    worker, grandchild = handler_pids(tmp_path, run_id)
    assert env.client.cancel(run_id)
    # kill_grace (0.3 s) plus the notification: well under two seconds.
    assert_group_gone(worker, grandchild, timeout=2)
    assert env.client.get_run(run_id).state == RunState.CANCELLED
    (step,) = env.client.steps(run_id)
    assert (step.state, step.error_kind) == (StepState.DISCARDED, ErrorKind.CANCELLED)
    replacement(sup, worker)
    assert "killing worker" in sup.log()


def test_a_stubborn_handler_dies_at_its_step_timeout_and_is_retried(
    env, supervisor, tmp_path
) -> None:
    from proc_flows import timed

    sup = supervisor()
    run_id = env.client.submit(timed, {"dir": str(tmp_path)})
    first = handler_pids(tmp_path, run_id, attempt=1)
    assert_group_gone(*first, timeout=4)
    # Timeouts are retried: the second attempt is killed the same way, then the step is dead.
    second = handler_pids(tmp_path, run_id, attempt=2)
    assert_group_gone(*second, timeout=4)
    status = wait_for(lambda: terminal(env, run_id), 5, "the run to fail")
    assert status.state == RunState.FAILED and status.error_kind == ErrorKind.TIMEOUT
    (step,) = env.client.steps(run_id)
    assert (step.state, step.error_kind, step.attempt) == (StepState.DEAD, ErrorKind.TIMEOUT, 2)
    assert "ran past its timeout" in step.error
    replacement(sup, second[0])


def replacement(sup, killed: int) -> None:
    wait_for(
        lambda: len(sup.workers()) == 2 and killed not in sup.workers(), 5, "a replacement worker"
    )

"""A planned stop (SIGTERM, a restart) gives back the steps it kills: no attempt is spent."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from proc_helpers import alive, wait_for

from cyclone.states import RunState, StepState

pytestmark = pytest.mark.process


def test_a_step_killed_at_shutdown_drain_is_released_with_its_only_attempt_unspent(
    env, supervisor, tmp_path: Path
) -> None:
    from proc_flows import stubborn  # ignores ctx.done and SIGTERM; max_attempts=1

    sup = supervisor(workers=1, shutdown="500ms")
    run_id = env.client.submit(stubborn, {"dir": str(tmp_path)})
    note = wait_for(lambda: list(tmp_path.glob("*.pids")), 10, "the step to start")[0]
    worker, grandchild = map(int, note.read_text().split())
    sup.popen.send_signal(signal.SIGTERM)
    assert sup.popen.wait(10) == 0, sup.log()
    assert not alive(worker) and not alive(grandchild)
    (step,) = env.client.steps(run_id)
    # Without the release: crashed, dead, and the run failed on its only attempt.
    assert (step.state, step.attempt, step.error_kind) == (StepState.AVAILABLE, 0, None)
    assert env.client.get_run(run_id).state == RunState.RUNNING
    assert "released after" in sup.log() and "recorded as crashed" not in sup.log()

"""A handler writing to its worker's channel costs that worker, never the supervisor (issue 22,
item 5): a line with fields of the wrong type, a flood, a forged `idle`."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from proc_helpers import terminal, wait_for

from cyclone.states import ErrorKind, RunState

pytestmark = pytest.mark.process

MODULES = '["proc_flows", "proc_line_flows"]'


def kills(log: str) -> list[str]:
    return re.findall(r"killing worker \d \(pid \d+\) step \d+ \S+: (\w+)", log)


def test_a_line_of_the_wrong_types_kills_its_sender_and_the_supervisor_goes_on(
    env, supervisor
) -> None:
    from proc_flows import busy
    from proc_line_flows import forge

    sup = supervisor(workers=2, workflows__modules=MODULES)
    bad = '{"step_id": "7", "token": 1, "run_id": [], "workflow": {}, "node": null, "attempt": 1}'
    run_id = env.client.submit(forge, {"line": f"leased {bad}"})
    status = wait_for(lambda: terminal(env, run_id), 15, "the forging run to end")
    (step,) = env.client.steps(run_id)
    assert (status.state, step.error_kind) == (RunState.FAILED, ErrorKind.CRASHED)
    assert "worker sent a bad message" in step.error and kills(sup.log()) == ["bad_message"]
    assert sup.popen.poll() is None
    other = env.client.submit(busy, {"dir": "/tmp", "n": 1})
    assert wait_for(lambda: terminal(env, other), 15, "a run after it").state == "completed"


def test_a_forged_idle_does_not_switch_the_steps_timeout_off(env, supervisor) -> None:
    from proc_line_flows import forge

    sup = supervisor(workers=1, workflows__modules=MODULES)
    run_id = env.client.submit(forge, {"line": "idle"})
    wait_for(lambda: terminal(env, run_id), 15, "the run to end")
    (step,) = env.client.steps(run_id)
    assert step.error_kind == ErrorKind.TIMEOUT and kills(sup.log()) == ["timeout"]


def test_a_flooding_worker_is_killed_and_another_workers_kill_lands_on_time(
    env, supervisor
) -> None:
    from proc_flows import timed
    from proc_line_flows import flood

    sup = supervisor(workers=2, workflows__modules=MODULES)
    flooding = env.client.submit(flood, {})
    wait_for(lambda: "lines-flood" in sup.log(), 10, "the flood to start")
    started = time.monotonic()
    hung = env.client.submit(timed, {"dir": "/tmp"})  # 1 s timeout, kill_grace 300 ms
    wait_for(lambda: terminal(env, flooding), 15, "the flooding run to end")
    assert "over 20000 lines in a second" in sup.log()
    (step,) = env.client.steps(hung)

    def first_attempt():
        return env.conn.execute(
            "SELECT started_at, ended_at, error_kind FROM cyclone_step_attempts"
            " WHERE step_id = %s AND attempt = 1", (step.id,),
        ).fetchone()  # fmt: skip

    # Its first attempt was killed by its 1 s timeout, on time, while the other worker flooded.
    first = wait_for(first_attempt, 15, "the hung step's first attempt to be killed")
    assert first["error_kind"] == ErrorKind.TIMEOUT
    assert first["ended_at"] - first["started_at"] < timedelta(seconds=2.5), sup.log()[-3000:]
    assert time.monotonic() - started < 30
    assert sup.popen.poll() is None
    assert sup.log().count("sent a bad message (") == 1  # one warning, not one per line

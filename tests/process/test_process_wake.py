"""A step made ready starts at once, and timers fire on time, though nothing polls (issue 23).

The supervisor polls every minute and its scanner passes every minute, so within the seconds
these tests allow, only a notification can explain a step that starts or a timer that fires:
a ready step wakes a supervisor that waits for work (cyclone_ready), a time set earlier than
the scanner means to wake notifies it (cyclone_timer). With the triggers of migration 22 gone,
every check here times out.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import proc_wake_flows as flows
import pytest
from proc_helpers import wait_for

import cyclone
from cyclone.engine.dlq import retry_dead_step
from cyclone.testing import TestEnv

pytestmark = pytest.mark.process

MODULES = '["proc_wake_flows"]'
# Far below the minute a poll or a pass would take, far above what a wake-up takes on a loaded
# two-core machine.
WITHIN = 15.0
QUIET = {"worker__poll_interval": '"60s"', "scanner__interval": '"60s"'}


@pytest.fixture(params=["true", "false"], ids=["dispatch", "own-leases"])
def client(request, env: TestEnv, supervisor) -> Iterator[cyclone.Client]:
    proc = supervisor(
        workers=2, supervisor__dispatch=request.param, workflows__modules=MODULES, **QUIET
    )
    with cyclone.Client(env.dsn) as client:
        # The workers' first look at start-up is over once a run went through: from here on
        # they wait to be woken.
        first = client.submit(flows.one, 0)
        try:
            client.wait(first, timeout=WITHIN)
        except TimeoutError:
            steps = env.conn.execute(
                "SELECT state, available_at, leased_by FROM cyclone_steps WHERE run_id = %s",
                (first,),
            ).fetchall()
            flag = env.conn.execute("SELECT last_value FROM cyclone_wake_ready").fetchone()
            pytest.fail(f"the first run never ended: {steps}, wake flag {flag}\n{proc.log()}")
        yield client


def state(env: TestEnv, run_id: str) -> str:
    return env.conn.execute("SELECT state FROM cyclone_runs WHERE id = %s", (run_id,)).fetchone()[
        "state"
    ]


def step_state(env: TestEnv, run_id: str, node: str) -> str | None:
    row = env.conn.execute(
        "SELECT state FROM cyclone_steps WHERE run_id = %s AND node = %s", (run_id, node)
    ).fetchone()
    return None if row is None else row["state"]


def test_each_way_a_step_becomes_ready_wakes_a_worker(
    env: TestEnv, client: cyclone.Client, tmp_path: Path
) -> None:
    # submit, submit_many, and completions that make the next steps (a join among them)
    assert client.result(client.submit(flows.one, 1), timeout=WITHIN) == {"t": 1}
    for run_id in client.submit_many(flows.one, [2, 3, 4]):
        client.wait(run_id, timeout=WITHIN)
    assert client.result(client.submit(flows.join, 5), timeout=WITHIN) == {"j": 5}
    # a child run's end
    client.wait(client.submit(flows.parent, 6), timeout=WITHIN)
    # a signal
    waiting = client.submit(flows.signalled, 7)
    wait_for(lambda: step_state(env, waiting, "go") == "waiting", WITHIN, "the wait reached")
    client.signal(waiting, "go")
    client.wait(waiting, timeout=WITHIN)
    # a resume: the signal came while the run was paused, its next step waits for the resume
    paused = client.submit(flows.signalled, 8)
    wait_for(lambda: step_state(env, paused, "go") == "waiting", WITHIN, "the wait reached")
    assert client.pause(paused)
    client.signal(paused, "go")
    wait_for(lambda: step_state(env, paused, "after") == "available", WITHIN, "its next step")
    assert client.resume(paused)
    client.wait(paused, timeout=WITHIN)
    # a DLQ retry
    marker = tmp_path / "marker"
    dead = client.submit(flows.dead_once, {"marker": str(marker)})
    wait_for(lambda: state(env, dead) == "failed", WITHIN, "the step dead-lettered")
    marker.touch()
    step_id = env.conn.execute("SELECT id FROM cyclone_steps WHERE run_id = %s", (dead,)).fetchone()
    retry_dead_step(env.conn, step_id["id"])
    assert client.result(dead, timeout=WITHIN) == {"f": "ok"}


def test_timers_fire_on_time_between_the_scanners_passes(
    env: TestEnv, client: cyclone.Client
) -> None:
    client.set_rate_limit("wake-rated", rate=2, burst=1)
    rated = client.submit_many(flows.rated, [1, 2, 3, 4])  # a token each half second
    retry = client.submit(flows.retried)  # backoff of about a second, then the retry
    sleep = client.submit(flows.slept, 1)  # a one-second sleep
    max_wait = client.submit(flows.unanswered)  # a wait of at most a second
    deadline = client.submit(flows.hung, run_deadline=1.0)  # a one-second deadline
    assert client.result(retry, timeout=WITHIN) == {"t": "ok"}
    assert client.result(sleep, timeout=WITHIN) == {"after": 1}
    for run_id in rated:  # the rate bucket's next_at wakes the held_steps sweep
        assert client.wait(run_id, timeout=WITHIN).state == "completed"
    for run_id in (max_wait, deadline):
        wait_for(lambda r=run_id: state(env, r) == "failed", WITHIN, f"run {run_id} failed")
        assert client.wait(run_id, timeout=WITHIN).state == "failed"
    kinds = env.conn.execute(
        "SELECT run_id::text, error_kind FROM cyclone_steps WHERE run_id IN (%s, %s)",
        (max_wait, deadline),
    ).fetchall()
    assert {r["run_id"]: r["error_kind"] for r in kinds} == {
        max_wait: "max_wait", deadline: "deadline"
    }

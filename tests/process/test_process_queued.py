"""Leases queued in a worker's name (supervisor/dispatch.py): a worker starts the next as it
finishes a step. None is lost or run twice when the worker is killed with some queued; a
step's timeout counts from its start, not from its queueing; a step whose run is cancelled
while it is queued never starts."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from proc_helpers import completed, terminal, wait_for

from cyclone.supervisor.dispatch import READY_FOR

pytestmark = pytest.mark.process

MODULES = '["proc_flows", "proc_queue_flows"]'


def start(supervisor, env):
    """One worker, warmed by a no-op step: the supervisor then takes its steps to be short,
    and leases ahead in its name."""
    from proc_queue_flows import queued

    sup = supervisor(workers=1, workflows__modules=MODULES)
    return sup, queued


def warm(env, queued, where: Path) -> None:
    """No-op steps, so that the average step its workers report is short (the first step of
    a worker takes longer: its first statements are planned)."""
    runs = env.client.submit_many(queued, [{"dir": str(where), "n": -1}] * 10)
    wait_for(lambda: all(completed(env, r) for r in runs), 15, "the warm-up runs")


def step_of(env, run_id: str) -> dict:
    return env.conn.execute(
        "SELECT id, state, attempt, started_at, completed_at FROM cyclone_steps"
        " WHERE run_id = %s", (run_id,),
    ).fetchone()  # fmt: skip


def leased(env, run_ids: list[str]) -> bool:
    return all(step_of(env, r)["state"] == "running" for r in run_ids)


def test_a_worker_killed_with_queued_leases_loses_none_and_spends_no_attempt(
    env, supervisor, tmp_path: Path
) -> None:
    from proc_queue_flows import starts

    sup, queued = start(supervisor, env)
    warm(env, queued, tmp_path)
    [worker] = sup.workers()
    # One slow step, and five queued behind it in its worker's name.
    runs = env.client.submit_many(
        queued, [{"dir": str(tmp_path), "n": 0, "sleep": 5}]
        + [{"dir": str(tmp_path), "n": n} for n in range(1, 6)],
    )  # fmt: skip
    wait_for(lambda: leased(env, runs) and any(s[0] == 0 for s in starts(tmp_path)),
             10, "the slow step to start, the others leased", interval=0.005)  # fmt: skip
    os.kill(worker, signal.SIGKILL)
    killed_at = time.monotonic()
    [slow_start] = [t for n, _, _, _, t in starts(tmp_path) if n == 0]
    # Killed while they were still young: the supervisor gives them back as it reaps the
    # worker, not because they aged (READY_FOR).
    assert killed_at - slow_start < READY_FOR, "too slow to kill the worker in time"
    assert all(s[0] in (-1, 0) for s in starts(tmp_path)), "a queued step ran before the kill"
    wait_for(lambda: all(completed(env, r) for r in runs), 30, f"every run\n{sup.log()}")
    ran = [s for s in starts(tmp_path) if s[0] > 0]
    # Each queued step ran once, on its first attempt: the queue spent none.
    assert sorted((n, attempt) for n, _, attempt, _, _ in ran) == [(n, 1) for n in range(1, 6)]
    assert [step_of(env, r)["attempt"] for r in runs[1:]] == [1] * 5
    assert all(pid != worker for _, _, _, pid, _ in ran)
    # The slow step was running: that attempt crashed, and the next one completed it.
    assert step_of(env, runs[0])["attempt"] == 2


def test_a_steps_timeout_counts_from_its_start_not_from_its_queueing(
    env, supervisor, tmp_path: Path
) -> None:
    from proc_queue_flows import TIMEOUT, starts, timed

    sup, queued = start(supervisor, env)
    warm(env, queued, tmp_path)
    # A step of 150 ms, and behind it, queued, a step that runs until 50 ms past TIMEOUT after
    # the first one started: past its timeout if that counted from the lease, not from its
    # own start (150 ms later).
    run = env.client.submit(timed, {"dir": str(tmp_path)})
    status = wait_for(lambda: terminal(env, run), TIMEOUT + 10, f"the timed run\n{sup.log()}")
    assert status.state == "completed", sup.log()
    steps = {s["node"]: s for s in env.conn.execute(
        "SELECT node, attempt, started_at, completed_at FROM cyclone_steps WHERE run_id = %s",
        (run,),
    ).fetchall()}  # fmt: skip
    # Leased ahead with the first step (one statement, one transaction time): queued while
    # that one ran, not leased after it.
    assert steps["until_after"]["started_at"] == steps["short"]["started_at"]
    assert steps["until_after"]["attempt"] == 1
    times = {n: t for n, _, _, _, t in starts(tmp_path)}
    assert times[1] - times[0] >= 0.15
    assert "past its timeout" not in sup.log()


def test_a_step_whose_run_is_cancelled_while_queued_never_starts(
    env, supervisor, tmp_path: Path
) -> None:
    from proc_queue_flows import starts

    sup, queued = start(supervisor, env)
    warm(env, queued, tmp_path)
    first, second = env.client.submit_many(
        queued, [{"dir": str(tmp_path), "n": 0, "sleep": 0.2}, {"dir": str(tmp_path), "n": 1}]
    )
    wait_for(lambda: leased(env, [first, second]) and any(s[0] == 0 for s in starts(tmp_path)),
             10, "the first step to start, the second leased", interval=0.005)  # fmt: skip
    env.client.cancel(second)
    [began] = [t for n, _, _, _, t in starts(tmp_path) if n == 0]
    assert time.monotonic() - began < 0.1, "too slow to cancel while the step was queued"
    wait_for(lambda: completed(env, first), 10, f"the first run\n{sup.log()}")
    assert terminal(env, second).state == "cancelled"
    time.sleep(READY_FOR)  # long past the moment it would have started
    assert [n for n, *_ in starts(tmp_path) if n >= 0] == [0], sup.log()
    assert "killing worker" not in sup.log()

"""Revocation checks kill only workers whose lease was really revoked (issue 11, item 3)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from proc_helpers import completed, wait_for

pytestmark = pytest.mark.process

MODULES = '["proc_flows", "proc_trust_flows"]'


def test_checks_racing_completions_kill_nobody_and_count_no_kill(
    env, supervisor, tmp_path: Path
) -> None:
    from proc_flows import stubborn
    from proc_trust_flows import fanout

    sup = supervisor(workers=2, workflows__modules=MODULES)
    run_id = env.client.submit(fanout, {"n": 600})
    # Every notification makes the supervisor check its workers' leases at once, so many
    # checks land between a step's record and its `done` line.
    deadline = time.monotonic() + 60
    while not completed(env, run_id) and time.monotonic() < deadline:
        for _ in range(10):
            env.conn.execute("SELECT pg_notify('cyclone_revoked', current_schema())")
            time.sleep(0.005)
    assert completed(env, run_id)
    assert "killing worker" not in sup.log()
    assert (sup.sample("cyclone_worker_kills_total", reason="cancel") or 0) == 0
    # A real cancel still kills at once, and counts.
    victim = env.client.submit(stubborn, {"dir": str(tmp_path)})
    wait_for(lambda: list(tmp_path.glob("*.pids")), 10, "the stubborn step to start")
    env.client.cancel(victim)
    wait_for(lambda: "killing worker" in sup.log(), 5, "the cancel kill")
    wait_for(
        lambda: sup.sample("cyclone_worker_kills_total", reason="cancel") == 1, 5, "one kill"
    )  # fmt: skip

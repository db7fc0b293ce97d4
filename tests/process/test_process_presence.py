"""A busy supervisor keeps publishing its presence (issue 11, item 2)."""

from __future__ import annotations

import time

import pytest
from proc_helpers import completed, wait_for

from cyclone.supervisor.presence import MAX_SILENCE

pytestmark = pytest.mark.process

MODULES = '["proc_flows", "proc_trust_flows"]'


def test_a_supervisor_always_near_a_kill_still_publishes_within_max_silence(
    env, supervisor
) -> None:
    from proc_trust_flows import short

    sup = supervisor(workers=2, workflows__modules=MODULES)
    run_ids = env.client.submit_many(short, [{"sleep": 0.05}] * 250)
    running = "SELECT count(*) AS n FROM cyclone_steps WHERE state = 'running'"
    wait_for(lambda: env.conn.execute(running).fetchone()["n"] == 2, 10, "both workers busy")
    seen = "SELECT extract(epoch FROM now() - seen_at)::float8 AS ago FROM cyclone_supervisors"
    worst = 0.0
    busy_until = time.monotonic() + 60
    while not completed(env, run_ids[-1]) and time.monotonic() < busy_until:
        rows = env.conn.execute(seen).fetchall()
        assert len(rows) == 1, "the busy supervisor's presence was removed"
        worst = max(worst, rows[0]["ago"])
        time.sleep(0.1)
    wait_for(lambda: all(completed(env, r) for r in run_ids), 30, "every run to complete")
    # Publishing waited for a moment with no kill close by, which never came while busy.
    assert worst < MAX_SILENCE + 1.5, f"not seen for {worst:.1f}s while busy\n{sup.log()}"

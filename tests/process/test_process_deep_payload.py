"""A run input nested too deep for Python's json, written past the client's checks (by SQL, or
a client older than the limit), costs its own step only, never the supervisor nor the steps
leased beside it (issue 22, item 3: every restart crashed again in the dispatcher's decode)."""

from __future__ import annotations

import pytest
from proc_flows import busy
from proc_helpers import completed, wait_for

pytestmark = pytest.mark.process

DEPTH = 2000  # the issue's ~990 and more: past the recursion limit of any decode


def test_a_run_input_too_deep_to_decode_costs_its_step_only(env, supervisor, tmp_path):
    poisoned = env.client.submit(busy, {"dir": str(tmp_path), "n": 0, "sleep": 0})
    deep = "[" * DEPTH + "]" * DEPTH
    # As the owner, past the client (which refuses it now).
    env.conn.execute(
        "UPDATE cyclone_runs SET input = jsonb_set(input, '{deep}', %s::jsonb) WHERE id = %s",
        (deep, poisoned),
    )
    # Steps leased in the same statements as the poisoned one.
    healthy = env.client.submit_many(
        busy, [{"dir": str(tmp_path), "n": n, "sleep": 0} for n in range(1, 9)]
    )
    sup = supervisor(
        workers=3, worker__lease_ttl='"2s"', worker__heartbeat_interval='"0.5s"',
        scanner__interval='"0.2s"',
    )  # fmt: skip
    wait_for(lambda: all(completed(env, r) for r in healthy), 60, f"healthy runs\n{sup.log()}")
    # The poisoned step is leased, its lease lapses, it is leased again: the supervisor reads
    # every one of those answers and lives, and hands the step to no worker.
    wait_for(
        lambda: env.conn.execute(
            "SELECT attempt FROM cyclone_steps WHERE run_id = %s AND node = 'work'", (poisoned,)
        ).fetchone()["attempt"] >= 2,
        60, f"the poisoned step leased twice\n{sup.log()}",
    )  # fmt: skip
    assert sup.popen.poll() is None, sup.log()
    log = sup.log()
    assert "levels deep (the limit is 100); its lease is not handed to a worker" in log, log
    assert "Traceback" not in log and "RecursionError" not in log, log
    # No healthy step paid for the poisoned one: each ran once, on its first lease.
    attempts = env.conn.execute(
        "SELECT max(attempt) AS most FROM cyclone_steps WHERE run_id = ANY(%s::uuid[])",
        (healthy,),
    ).fetchone()["most"]
    assert attempts == 1

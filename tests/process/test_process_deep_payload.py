"""A run input nested too deep for Python's json, written past the client's checks (by SQL, or
a client older than the limit), costs its batch and its step, never the supervisor (issue 22,
item 3: every restart crashed again in the dispatcher's decode)."""

from __future__ import annotations

import pytest
from proc_flows import busy
from proc_helpers import completed, wait_for

pytestmark = pytest.mark.process

DEPTH = 2000  # the issue's ~990 and more: past the recursion limit of any decode


def test_a_run_input_too_deep_to_decode_never_stops_the_supervisor(env, supervisor, tmp_path):
    poisoned = env.client.submit(busy, {"dir": str(tmp_path), "n": 0, "sleep": 0})
    deep = "[" * DEPTH + "]" * DEPTH
    # As the owner, past the client (which refuses it now).
    env.conn.execute(
        "UPDATE cyclone_runs SET input = jsonb_set(input, '{deep}', %s::jsonb) WHERE id = %s",
        (deep, poisoned),
    )
    sup = supervisor(
        workers=2, worker__lease_ttl='"2s"', worker__heartbeat_interval='"0.5s"',
        scanner__interval='"0.2s"',
    )  # fmt: skip
    # The poisoned step is leased, its lease lapses, it is leased again: the supervisor reads
    # every one of those answers and lives.
    wait_for(
        lambda: env.conn.execute(
            "SELECT attempt FROM cyclone_steps WHERE run_id = %s AND node = 'work'", (poisoned,)
        ).fetchone()["attempt"] >= 2,
        60, f"the poisoned step leased twice\n{sup.log()}",
    )  # fmt: skip
    assert sup.popen.poll() is None, sup.log()
    healthy = env.client.submit_many(
        busy, [{"dir": str(tmp_path), "n": n, "sleep": 0} for n in range(1, 6)]
    )
    wait_for(lambda: all(completed(env, r) for r in healthy), 60, f"healthy runs\n{sup.log()}")
    assert sup.popen.poll() is None, sup.log()
    assert "RecursionError" in sup.log() and "Traceback" not in sup.log(), sup.log()

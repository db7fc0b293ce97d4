"""The supervisor leases for its workers and records their finished tasks, or lets them."""

from __future__ import annotations

import pytest
from proc_flows import busy
from proc_helpers import completed, wait_for

pytestmark = pytest.mark.process

RUNS = 30


def drain(env, sup, tmp_path) -> None:
    runs = env.client.submit_many(
        busy, [{"dir": str(tmp_path), "n": i, "sleep": 0} for i in range(RUNS)]
    )
    wait_for(lambda: all(completed(env, r) for r in runs), 30, "every run to complete")
    steps = env.conn.execute(
        "SELECT count(*) AS n, count(*) FILTER (WHERE attempt = 1) AS once FROM cyclone_steps"
    ).fetchone()
    assert steps == {"n": 2 * RUNS, "once": 2 * RUNS}
    assert [env.client.result(r) for r in runs] == [{"after": i + 1} for i in range(RUNS)]


def test_the_supervisor_leases_every_step_its_workers_run(env, supervisor, tmp_path) -> None:
    sup = supervisor(workers=3)
    drain(env, sup, tmp_path)
    # Every lease came from its dispatch statements: none from a worker's own session.
    assert sup.sample("cyclone_dispatch_batch_steps_sum") == 2 * RUNS
    assert sup.sample("cyclone_leases_total", workflow=busy.name, node="work") == RUNS
    assert sup.sample("cyclone_steps_total", workflow=busy.name, node="after",
                      outcome="completed") == RUNS  # fmt: skip


def test_with_dispatch_off_each_worker_leases_on_its_own(env, supervisor, tmp_path) -> None:
    sup = supervisor(workers=3, supervisor__dispatch="false")
    drain(env, sup, tmp_path)
    assert sup.sample("cyclone_dispatch_batch_steps_count") == 0
    assert sup.sample("cyclone_steps_total", workflow=busy.name, node="after",
                      outcome="completed") == RUNS  # fmt: skip

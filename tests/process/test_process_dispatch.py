"""The supervisor leases for its workers and records their finished tasks, or lets them."""

from __future__ import annotations

import os

import pytest
from proc_flows import busy
from proc_helpers import completed, wait_for

from cyclone.supervisor.processes import OsProcessOps

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


def test_a_worker_dead_with_an_answer_unread_reads_as_gone() -> None:
    """The kernel resets, rather than closes, a socket closed with data unread in it: the
    supervisor reads that as the child gone, as it reads a closed pipe (chaos.py found it)."""
    ops = OsProcessOps()

    def child(fd: int) -> int:
        os.read(fd, 1)  # the first byte only: the rest stays unread when it exits
        return 0

    pid, fd = ops.spawn(child, close_fds=[])
    try:
        os.write(fd, b"x" + b'given {"recorded":null}\n' * 4)
        assert os.waitpid(pid, 0)[0] == pid
        got: list[bytes | None] = []
        wait_for(lambda: got.append(ops.read(fd)) or got[-1] is not None, 5, "end of file")
        assert got[-1] == b""
    finally:
        ops.close(fd)

"""Every process a step started ends with the step: daemons a handler made (double fork and
setsid, out of the worker's process group) included. And `[worker] max_memory` bounds a worker."""

from __future__ import annotations

from pathlib import Path

from proc_helpers import _stat, alive, terminal, wait_for

from cyclone.states import ErrorKind, RunState

MODULES = '["proc_reaper_flows"]'


def noted(tmp: Path, run_id: str, what: str) -> int:
    note = tmp / f"{run_id}.1.{what}"
    return int(wait_for(lambda: note.exists() and note.read_text(), 15, note.name))


def test_a_daemon_a_handler_started_dies_with_its_step_at_the_timeout_kill(
    env, supervisor, tmp_path
) -> None:
    from proc_reaper_flows import escapes

    sup = supervisor(workflows__modules=MODULES)
    run_id = env.client.submit(escapes, {"dir": str(tmp_path)})
    worker, daemon = noted(tmp_path, run_id, "worker"), noted(tmp_path, run_id, "daemon")
    stat, worker_stat = _stat(daemon), _stat(worker)
    assert stat is not None and worker_stat is not None and alive(daemon)
    # It escaped: another session and group, so the kill of the worker's group misses it.
    # Its parent is gone; the worker, a subreaper, adopted it.
    assert int(stat[2]) != worker and stat[3] != worker_stat[3]
    assert int(stat[1]) == worker
    status = wait_for(lambda: terminal(env, run_id), 10, "the run to fail")
    assert (status.state, status.error_kind) == (RunState.FAILED, ErrorKind.TIMEOUT)
    wait_for(lambda: not alive(daemon), 5, f"the daemon {daemon} to be killed")
    assert not alive(worker)
    wait_for(lambda: "left behind by a worker" in sup.log(), 5, "the supervisor's log line")


def test_a_daemon_left_by_a_step_that_completed_is_gone_once_it_is_recorded(
    env, supervisor, tmp_path
) -> None:
    from proc_reaper_flows import leaves

    sup = supervisor(workflows__modules=MODULES)
    run_id = env.client.submit(leaves, {"dir": str(tmp_path)})
    status = wait_for(lambda: terminal(env, run_id), 15, "the run to complete")
    assert status.state == RunState.COMPLETED
    daemon = status.output["leave"]
    # Killed and reaped before the step was recorded: no wait needed.
    assert not alive(daemon)
    assert "the handler left running" in sup.log()
    # The worker lives on, for the next step.
    assert noted(tmp_path, run_id, "worker") in sup.workers()


def test_max_memory_bounds_what_a_handler_allocates(env, supervisor, tmp_path) -> None:
    from proc_reaper_flows import hog

    supervisor(workflows__modules=MODULES, worker__max_memory='"256M"')
    small = env.client.submit(hog, {"mib": 16})
    big = env.client.submit(hog, {"mib": 512})
    ok = wait_for(lambda: terminal(env, small), 15, "the small allocation")
    assert ok.state == RunState.COMPLETED
    assert ok.output["allocate"] == [256 << 20, 256 << 20]
    failed = wait_for(lambda: terminal(env, big), 15, "the big allocation")
    assert (failed.state, failed.error_kind) == (RunState.FAILED, ErrorKind.ERROR)
    assert "MemoryError" in failed.error


def test_a_pid_whose_parent_is_not_the_one_seen_is_not_signalled() -> None:
    """A pid from the /proc snapshot that now names another process (its parent differs) is
    left alone: the snapshot's pid may have been freed and reused."""
    import subprocess

    from cyclone.child import reaper

    shell = subprocess.Popen(
        ["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True
    )
    try:
        sleeper = int(shell.stdout.readline())
        assert reaper._kill([sleeper], {sleeper: 999_999}) == []  # not the parent seen
        assert alive(sleeper)
        assert reaper._kill([sleeper], {sleeper: shell.pid}) == [sleeper]
        wait_for(lambda: not alive(sleeper), 5, "the sleeper to die")
    finally:
        shell.kill()
        shell.wait(10)
        shell.stdout.close()

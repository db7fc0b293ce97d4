"""Supervisors starting, crashing, draining and sharing a database, as real processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from proc_helpers import alive, completed, group_members, wait_for

from cyclone.states import StepState

pytestmark = pytest.mark.process


def spans(tmp: Path) -> dict[int, list[tuple[str, float]]]:
    """The busy workflow's start/end lines, by step id."""
    log = tmp / "spans.log"
    by_step: dict[int, list[tuple[str, float]]] = defaultdict(list)
    if log.exists():
        for line in log.read_text().splitlines():
            event, step_id, at, _pid = line.split()
            by_step[int(step_id)].append((event, float(at)))
    return by_step


def test_a_worker_exiting_mid_step_fails_the_attempt_as_crashed_then_it_is_retried(
    env, supervisor
) -> None:
    from proc_flows import crashy

    sup = supervisor()
    run_id = env.client.submit(crashy, {})
    wait_for(lambda: completed(env, run_id), 10, "the run to complete")
    (step,) = env.client.steps(run_id)
    assert (step.state, step.attempt) == (StepState.COMPLETED, 2)
    assert env.client.get_run(run_id).output == {"crash_once": "survived on attempt 2"}
    assert "recorded as crashed" in sup.log(), sup.log()
    # The handler's os._exit(3), not the worker's own exit 3 (boot_error): no backoff.
    (first,) = env.client.attempts(step.id)
    assert first.error == "handler called os._exit(3) (or ended its process in a like way)"
    assert "failed to boot" not in sup.log()
    wait_for(lambda: len(sup.workers()) == 2, 5, "a replacement worker")
    metrics = sup.metrics()
    assert 'cyclone_worker_restarts_total{reason="handler_exit"} 1.0' in metrics
    labels = 'node="crash_once",outcome="{}",workflow="proc-crashy"'
    assert f"cyclone_steps_total{{{labels.format('crashed')}}} 1.0" in metrics
    assert f"cyclone_steps_total{{{labels.format('completed')}}} 1.0" in metrics


def test_workers_die_within_two_seconds_of_their_supervisor_and_a_new_one_finishes_the_step(
    env, supervisor, tmp_path
) -> None:
    from proc_flows import busy

    first = supervisor()
    run_id = env.client.submit(busy, {"dir": str(tmp_path), "n": 1, "sleep": 1.0})
    wait_for(lambda: spans(tmp_path), 10, "the step to start")
    children = first.workers() + first.scanners()
    first.popen.send_signal(signal.SIGKILL)
    first.popen.wait(5)
    wait_for(lambda: not any(alive(pid) for pid in children), 2, "the workers to die")
    assert all(group_members(pid) == [] for pid in children)
    supervisor()  # picks the step up once its lease (3 s) expires
    wait_for(lambda: completed(env, run_id), 15, "the run to complete")
    (events,) = spans(tmp_path).values()
    assert [e for e, _ in events] == ["start", "start", "end"]  # recorded once
    work = next(s for s in env.client.steps(run_id) if s.node == "work")
    assert (work.state, work.attempt) == (StepState.COMPLETED, 2)


def test_sigterm_lets_the_running_step_finish_then_exits_0(env, supervisor, tmp_path) -> None:
    from proc_flows import busy

    sup = supervisor()
    run_id = env.client.submit(busy, {"dir": str(tmp_path), "n": 1, "sleep": 1.0})
    wait_for(lambda: spans(tmp_path), 10, "the step to start")
    children = sup.workers() + sup.scanners()
    sup.popen.send_signal(signal.SIGTERM)
    assert sup.popen.wait(10) == 0, sup.log()
    assert not any(alive(pid) for pid in children)
    work = next(s for s in env.client.steps(run_id) if s.node == "work")
    assert work.state == StepState.COMPLETED
    assert "draining" in sup.log()


def test_two_supervisors_on_one_database_run_every_step_and_none_twice_at_once(
    env, supervisor, tmp_path
) -> None:
    from proc_flows import busy

    first, second = supervisor(), supervisor()
    inputs = [{"dir": str(tmp_path), "n": n, "sleep": 0.01} for n in range(40)]
    run_ids = env.client.submit_many(busy, inputs)
    wait_for(lambda: all(completed(env, r) for r in run_ids), 30, "every run to complete")
    outputs = [env.client.get_run(r).output for r in run_ids]
    assert outputs == [{"after": n + 1} for n in range(40)]
    by_step = spans(tmp_path)
    assert len(by_step) == 40
    for events in by_step.values():
        # No attempt was lost, so each step ran exactly once: one start, then one end.
        assert [e for e, _ in events] == ["start", "end"]
    pids = {int(line.split()[3]) for line in (tmp_path / "spans.log").read_text().splitlines()}
    for sup in (first, second):  # the work was shared: each supervisor's workers ran some
        assert pids & (sup.seen | set(sup.workers())), f"supervisor {sup.pid} ran nothing"


def test_a_stopped_worker_is_killed_once_silent_for_a_lease_and_its_step_completes_elsewhere(
    env, supervisor, tmp_path
) -> None:
    from proc_flows import busy

    sup = supervisor()
    run_id = env.client.submit(busy, {"dir": str(tmp_path), "n": 1, "sleep": 1.0})
    wait_for(lambda: spans(tmp_path), 10, "the step to start")
    stopped = next(pid for pid in sup.workers() if _runs_step(pid, tmp_path))
    os.kill(stopped, signal.SIGSTOP)
    try:
        # Stopped, it is not renewed: the supervisor kills it before its lease (3 s) can lapse,
        # the scanner or the supervisor fails the attempt, and the other worker runs it again.
        wait_for(lambda: completed(env, run_id), 15, "the run to complete elsewhere")
        wait_for(lambda: not alive(stopped), 5, "the stopped worker to be killed")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
    assert group_members(stopped) == []
    work = next(s for s in env.client.steps(run_id) if s.node == "work")
    assert (work.state, work.attempt) == (StepState.COMPLETED, 2)
    assert env.client.get_run(run_id).output == {"after": 2}
    # Killed as frozen, or for its reclaimed lease if the scanner got there first.
    assert re.search(
        r"killing worker \d \(pid \d+\) step \d+ .*: (frozen|lease_expired)", sup.log()
    )


def _runs_step(pid: int, tmp: Path) -> bool:
    lines = (tmp / "spans.log").read_text().split()
    return str(pid) in lines


def run_supervisor(config: Path, **environ: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cyclone.supervisor", "--config", str(config)],
        env={**os.environ, **environ}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_a_bad_config_exits_2_with_one_line_naming_the_key(tmp_path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[supervisor]\nworkerz = 2\n")
    done = run_supervisor(config)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "workerz" in done.stderr and str(config) in done.stderr


def test_an_unreachable_database_exits_3_without_showing_the_password(tmp_path) -> None:
    config = tmp_path / "ok.toml"
    config.write_text("[supervisor]\nworkers = 1\n")
    url = "postgresql://cyclone:hunter2secret@127.0.0.1:1/cyclone?connect_timeout=2"
    done = run_supervisor(config, CYCLONE_DATABASE_URL=url)
    assert done.returncode == 3, done.stderr
    assert "hunter2secret" not in done.stdout + done.stderr


def test_ttin_and_ttou_resize_and_sighup_replaces_every_worker(supervisor) -> None:
    sup = supervisor()
    os.kill(sup.pid, signal.SIGTTIN)
    wait_for(lambda: len(sup.workers()) == 3, 5, "a third worker")
    os.kill(sup.pid, signal.SIGTTOU)
    wait_for(lambda: len(sup.workers()) == 2, 5, "back to two workers")
    before = set(sup.workers()) | set(sup.scanners())
    os.kill(sup.pid, signal.SIGHUP)
    wait_for(
        lambda: len(sup.workers()) == 2 and not before & set(sup.workers() + sup.scanners()),
        10, "new workers and a new scanner",
    )  # fmt: skip
    assert len(sup.scanners()) == 1
    assert "config reloaded" in sup.log()
    assert sup.popen.poll() is None

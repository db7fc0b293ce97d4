"""History (issue 25, migration 18): finished runs move out of the hot tables into partitions
by time, every read of a run finds them there, and retention drops partitions whole."""

from __future__ import annotations

import json
from datetime import UTC, timedelta

import pytest
from cli_support import run_cli

import cyclone
from cyclone import engine
from cyclone.engine.sweeps import BUDGET, Sweep
from cyclone.scanner.base import Sweeper
from cyclone.states import RunState, StepState

tasks = cyclone.Workflow("history-task")


@tasks.task(max_attempts=2)
def one(ctx):
    if ctx.attempt == 1:
        raise RuntimeError("first try fails")
    return {"n": 1}


fails = cyclone.Workflow("history-fail")


@fails.task(max_attempts=1)
def boom(ctx):
    raise RuntimeError("boom")


parents = cyclone.Workflow("history-parent")
parents.child("sub", tasks, after=[parents.task(one, name="first")])


@pytest.fixture
def env(env):
    env.register(tasks, fails, parents)
    return env


def move(env, after: float = 60, retention: float = 3600, at: timedelta = timedelta(0)) -> int:
    return engine.sweep_history(
        env.conn, history_after=after, retention=retention, batch_size=100, now=env.now() + at
    )


def count(env, table: str) -> int:
    return env.conn.execute(f"SELECT count(*) AS n FROM {table}").fetchone()["n"]


def test_finished_runs_move_with_their_children_steps_and_attempts(env) -> None:
    done = env.client.submit(tasks, {})
    parent = env.client.submit(parents, {})
    failed = env.client.submit(fails, {})
    keyed = env.client.submit(tasks, {}, key="kept-hot")
    for run in (done, parent, failed, keyed):
        env.run_until_complete(run)
    waiting = env.client.submit(tasks, {})  # not run: live
    before = {run: env.client.get_run(run) for run in (done, parent, failed, keyed)}
    steps_before = env.client.steps(parent)
    # Not yet history_after past their end: nothing moves.
    assert move(env, at=timedelta(seconds=30)) == 0
    assert move(env, at=timedelta(seconds=90)) == 2  # top-level runs: done and parent
    # The child run went with its parent; failed and keyed runs stay hot (DLQ, repeat submits).
    hot = {str(r["id"]) for r in env.conn.execute("SELECT id FROM cyclone_runs").fetchall()}
    assert hot == {failed, keyed, waiting}
    assert count(env, "cyclone_history_runs") == 3
    # Every read finds a moved run as it was.
    for run in (done, parent, failed, keyed):
        assert env.client.get_run(run) == before[run]
    assert env.client.steps(parent) == steps_before
    (first,) = [s for s in env.client.steps(done)]
    assert first.state == StepState.COMPLETED and first.attempt == 2
    attempts = env.client.attempts(first.id)
    assert [a.error.splitlines()[0] for a in attempts] == ["RuntimeError: first try fails"]
    assert env.client.step(first.id) == first
    assert env.client.result(done) == {"one": {"n": 1}}
    views = env.conn.execute(
        "SELECT r.id::text AS id, r.steps_total, s.attempts FROM cyclone_v_runs r"
        " JOIN cyclone_v_steps s ON s.run_id = r.id WHERE r.id = %s",
        [done],
    ).fetchone()
    assert views["steps_total"] == 1 and len(views["attempts"]) == 1
    # Moving again moves nothing: a run is in one place only.
    assert move(env, at=timedelta(seconds=90)) == 0
    assert count(env, "cyclone_steps") + count(env, "cyclone_history_steps") == len(
        env.conn.execute(
            "SELECT id FROM cyclone_steps UNION SELECT id FROM cyclone_history_steps"
        ).fetchall()
    )


def test_the_cli_lists_hot_and_moved_runs_newest_first(env, capsys) -> None:
    runs = [env.client.submit(tasks, {}) for _ in range(3)]
    for run in runs:
        env.run_until_complete(run)
    hot = env.client.submit(fails, {})
    env.run_until_complete(hot)
    assert move(env, at=timedelta(minutes=5)) == 3
    listed = run_cli(capsys, env, "runs", "--json").json()
    assert [r["id"] for r in listed] == [hot, *reversed(runs)]
    steps = run_cli(capsys, env, "steps", runs[0], "--json").json()
    assert [s["node"] for s in steps] == ["one"]
    shown = run_cli(capsys, env, "run", runs[0], "--json")
    assert shown.code == 0 and shown.json()["state"] == "completed"


def test_retention_drops_whole_partitions_once_past_it(env) -> None:
    run = env.client.submit(tasks, {})
    env.run_until_complete(run)
    assert move(env, retention=600, at=timedelta(minutes=2)) == 1
    (part,) = env.conn.execute("SELECT lo, hi FROM cyclone_history_partitions").fetchall()
    # The span is an eighth of the retention, at least ten seconds.
    assert part["hi"] - part["lo"] == timedelta(seconds=75)
    drop = engine.sweep_history_drop
    assert drop(env.conn, retention=600, now=env.now() + timedelta(minutes=5)) == 0
    gone = part["hi"] + timedelta(seconds=601)
    assert drop(env.conn, retention=600, now=gone, history_after=60) == 1
    assert count(env, "cyclone_history_runs") == 0
    with pytest.raises(cyclone.RunNotFound):
        env.client.get_run(run)
    suffix = part["lo"].astimezone(UTC).strftime("%Y%m%d_%H%M%S")
    tables = env.conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE %s",
        [f"%{suffix}"],
    ).fetchall()
    assert tables == []
    # The next partitions were made ahead of the moves.
    ahead = env.conn.execute("SELECT count(*) AS n FROM cyclone_history_partitions").fetchone()
    assert ahead["n"] >= 2


def test_an_archive_sees_each_partition_before_it_is_dropped(env) -> None:
    run = env.client.submit(tasks, {})
    env.run_until_complete(run)
    assert move(env, retention=600, at=timedelta(minutes=2)) == 1
    seen: list[list[str]] = []

    def archive(conn, lo, hi) -> None:
        rows = conn.execute(
            "SELECT id::text FROM cyclone_history_runs WHERE run_ended_at >= %s"
            " AND run_ended_at < %s",
            [lo, hi],
        ).fetchall()
        seen.append([r["id"] for r in rows])

    later = env.now() + timedelta(hours=1)
    assert engine.sweep_history_drop(env.conn, retention=600, now=later, archive=archive) == 1
    assert seen == [[run]]


def test_a_partition_whose_archive_fails_is_kept(env, tmp_path) -> None:
    run = env.client.submit(tasks, {})
    env.run_until_complete(run)
    assert move(env, retention=600, at=timedelta(minutes=2)) == 1
    later = env.now() + timedelta(hours=1)
    drop = engine.sweep_history_drop
    assert drop(env.conn, retention=600, now=later, archive_dir=str(tmp_path / "missing")) == 0
    assert count(env, "cyclone_history_runs") == 1 and list(tmp_path.iterdir()) == []


def test_an_archive_directory_gets_one_file_per_partition(env, tmp_path) -> None:
    run = env.client.submit(tasks, {})
    env.run_until_complete(run)
    assert move(env, retention=600, at=timedelta(minutes=2)) == 1
    later = env.now() + timedelta(hours=1)
    assert (
        engine.sweep_history_drop(env.conn, retention=600, now=later, archive_dir=str(tmp_path))
        == 1
    )
    (written,) = tmp_path.iterdir()
    assert written.name.startswith("cyclone-history-") and written.suffix == ".jsonl"
    (line,) = written.read_text().splitlines()
    assert json.loads(line)["run"]["output"] == {"one": {"n": 1}}


def test_runs_past_the_retention_are_not_moved_but_left_to_retention(env) -> None:
    run = env.client.submit(tasks, {})
    env.run_until_complete(run)
    assert move(env, retention=600, at=timedelta(hours=1)) == 0
    sweep = Sweeper(next(s for s in engine.SWEEPS if s.name == "retention"), batch_size=10,
                    settings={"retention": 600})  # fmt: skip
    assert sweep.run_once(env.conn, now=env.now() + timedelta(hours=1)) == 1
    assert count(env, "cyclone_runs") == 0


def test_a_sweep_with_a_budget_batches_while_behind_past_the_old_cap() -> None:
    results = [2] * 50 + [1]
    calls: list[int] = []

    def sweep_counting(conn, *, batch_size, now=None) -> int:
        calls.append(batch_size)
        return results.pop(0)

    sweep = Sweeper(Sweep("counting", sweep_counting, budget=BUDGET), batch_size=2)
    assert sweep.run(None, pause=lambda _: pytest.fail("no pause while behind")) == 101
    assert len(calls) == 51  # the old cap was 20 batches a pass


def test_a_moved_run_keeps_its_state_for_waiters(env) -> None:
    run = env.client.submit(tasks, {})
    env.run_until_complete(run)
    assert move(env, at=timedelta(minutes=5)) == 1
    assert env.client.wait(run, timeout=5).state == RunState.COMPLETED

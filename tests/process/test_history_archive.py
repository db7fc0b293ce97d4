"""Archival to a command (issue 25, item 2): the scanner pipes each partition of history,
as JSON lines, to `[scanner] archive_command` before it drops it, and keeps it when the
command fails. A process test: the command is a real shell."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

import cyclone
from cyclone import engine

tasks = cyclone.Workflow("archive-task")


@tasks.task(max_attempts=2)
def one(ctx):
    if ctx.attempt == 1:
        raise RuntimeError("first try fails")
    return {"n": 1}


parents = cyclone.Workflow("archive-parent")
parents.child("sub", tasks, after=[parents.task(one, name="first")])


@pytest.fixture
def env(env):
    env.register(tasks, parents)
    return env


def count(env, table: str) -> int:
    return env.conn.execute(f"SELECT count(*) AS n FROM {table}").fetchone()["n"]


def test_history_is_archived_as_json_lines_and_kept_when_archiving_fails(env, tmp_path) -> None:
    parent = env.client.submit(parents, {})
    env.run_until_complete(parent)
    moved = engine.sweep_history(
        env.conn, history_after=60, retention=600, batch_size=100,
        now=env.now() + timedelta(minutes=2),
    )  # fmt: skip
    assert moved == 1
    later = env.now() + timedelta(hours=1)
    drop = engine.sweep_history_drop
    # A command that fails: nothing is dropped, nothing half-written is left for a directory.
    assert drop(env.conn, retention=600, now=later, archive_command="cat > /dev/null; exit 3") == 0
    assert count(env, "cyclone_history_runs") == 2
    piped = tmp_path / "piped.jsonl"
    command = f'test -n "$CYCLONE_ARCHIVE_FROM" && cat > {piped}'
    assert drop(env.conn, retention=600, now=later, archive_command=command) == 1
    (lines,) = {piped.read_text()}
    runs = [json.loads(line) for line in lines.splitlines()]
    assert len(runs) == 2 and parent in {r["run"]["id"] for r in runs}
    child = next(r for r in runs if r["run"]["parent_run_id"] == parent)
    assert [s["node"] for s in child["steps"]] == ["one"]
    # The failed first attempt, traceback and all (its backslashes and newlines intact).
    (attempt,) = child["steps"][0]["attempts"]
    assert attempt["error"].startswith("RuntimeError: first try fails\nTraceback")
    assert count(env, "cyclone_history_runs") == 0

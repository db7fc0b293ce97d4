"""`cyclone status` on a small terminal: what an operator needs first, within 80x24.

Presence rows are written by hand (as in test_status.py) so the screen holds more workers and
lost supervisors than fit, and every line can be checked against the size of the terminal.
"""

from __future__ import annotations

import dataclasses
import io
import re
from datetime import timedelta

import pytest
from cli_support import approve, deadline_killed, failed_run, run_cli
from rich.console import Console

from cyclone import engine
from cyclone.status import take_snapshot
from cyclone.status.render import render
from cyclone.testing import TestEnv

# A workflow and node name long enough that a worker's step text must be cut at 80 columns.
LONG = "invoice-reconciliation-for-the-northern-region-warehouses"


@pytest.fixture
def cenv(env: TestEnv) -> TestEnv:
    env.register(approve)
    return env


def seed(env: TestEnv, busy: int, idle: int, lost: int, name: str = LONG) -> dict[str, object]:
    """A live supervisor with `busy` + `idle` workers, `lost` lost ones, a run failed by its
    deadline, a failed run and two paused runs."""
    killed = deadline_killed(env)
    failed_run(env)
    paused = [env.client.submit(approve, {}, run_deadline=timedelta(minutes=30)) for _ in range(2)]
    for run_id in paused:
        env.client.pause(run_id)
    run_id = env.client.submit(approve, {}, run_deadline=timedelta(minutes=20))
    lease = engine.lease_step(env.conn, worker="vm-1:100:1", lease_ttl=30, now=env.now())
    assert lease is not None
    env.conn.execute(
        "INSERT INTO cyclone_supervisors (id, host, pid, workers_target, started_at, seen_at)"
        " SELECT 'sup-live', 'vm-1', 100, %s, now() - interval '1 hour', now()"
        " UNION ALL"
        " SELECT 'sup-lost-' || i, 'vm-lost-' || i, 200 + i, 4, now() - interval '2 hours',"
        "        now() - interval '5 min'"
        "   FROM generate_series(1, %s) AS i",
        (busy + idle, lost),
    )
    env.conn.execute(
        "INSERT INTO cyclone_workers (supervisor_id, slot, pid, state, step_id, run_id,"
        "                             workflow, node, attempt, busy_since)"
        " SELECT 'sup-live', i, 1000 + i, 'busy', %s::bigint, %s::uuid, %s, %s, 1,"
        "        now() - make_interval(secs => i)"
        "   FROM generate_series(1, %s) AS i"
        " UNION ALL"
        " SELECT 'sup-live', i, 1000 + i, 'idle', NULL, NULL, NULL, NULL, NULL, NULL::timestamptz"
        "   FROM generate_series(%s + 1, %s) AS i",
        (lease.step_id, run_id, name, name, busy, busy, busy + idle),
    )
    return {"killed": killed, "paused": paused, "step_id": lease.step_id, "run_id": run_id}


def draw(env: TestEnv, width: int, height: int | None) -> list[str]:
    out = Console(file=io.StringIO(), width=width, height=height or 1000, highlight=False)
    out.print(render(take_snapshot(env.conn), width=width, height=height))
    return out.file.getvalue().splitlines()


def test_at_80x24_the_urgent_sections_come_first_and_everything_fits(cenv):
    seeded = seed(cenv, busy=30, idle=5, lost=4)
    lines = draw(cenv, 80, 23)
    text = "\n".join(lines)
    assert len(lines) <= 23 and max(len(line) for line in lines) <= 80, text
    starts = [line.split()[0] for line in lines if line.strip()]
    for section in ("queue", "runs", "DLQ", "LOST", "deadline", "paused", "workers"):
        assert section in starts, (section, text)
    # In that order: the queue, the DLQ and lost supervisors before deadline failures, paused
    # runs and the workers.
    order = [starts.index(s) for s in ("queue", "DLQ", "LOST", "deadline", "paused", "workers")]
    assert order == sorted(order), text
    assert str(seeded["killed"]) in text  # a run id is never cut
    for run_id in seeded["paused"]:
        assert str(run_id) in text
    assert "1 more lost supervisor(s)" in text
    cut = [line for line in lines if line.endswith("…")]
    assert cut and all(LONG[:10] in line for line in cut), cut  # only step text is cut
    assert "more busy worker(s)" in text  # the workers that did not fit are counted
    workers = [line for line in lines if f" {seeded['step_id']} {LONG[:10]}" in line]
    assert workers and all(line.endswith("…") and len(line) <= 80 for line in workers)


def test_at_200x50_a_small_cluster_gets_the_full_tables(cenv):
    seeded = seed(cenv, busy=1, idle=1, lost=1, name="cli-approve")
    lines = draw(cenv, 200, 49)
    text = "\n".join(lines)
    assert len(lines) <= 49 and max(len(line) for line in lines) <= 200, text
    for title in ("Supervisors", "Workers", "DLQ by reason", "Recent deadline failures"):
        assert title in text
    assert str(seeded["killed"]) in text and f"#{seeded['step_id']}" in text


def test_a_cluster_too_big_for_the_full_tables_gets_the_compact_screen_at_200x50(cenv):
    seeded = seed(cenv, busy=60, idle=0, lost=0, name="cli-approve-in-batches")
    lines = draw(cenv, 200, 49)
    assert len(lines) <= 49 and "Workers" not in "\n".join(lines)
    assert "more busy worker(s)" in lines[-1]
    workers = [line for line in lines if f" {seeded['step_id']} cli-approve-in" in line]
    # Wide enough: each worker's run id is on its line, whole; at 80 columns (issue 27, item
    # 10) on the line under it, whole, never left out.
    assert workers and all(line.endswith(f"run {seeded['run_id']}") for line in workers)
    narrow = draw(cenv, 80, 23)
    runs = [i for i, line in enumerate(narrow) if line.strip() == f"run {seeded['run_id']}"]
    assert runs and all(f" {seeded['step_id']} cli-approve-in" in narrow[i - 1] for i in runs)
    assert not [line for line in narrow if str(seeded["run_id"])[:8] in line and "…" in line]


def test_at_80_columns_the_dlq_and_the_database_error_fold_not_cut(cenv):
    """Issue 27, item 10: what an operator acts on is never cut with an ellipsis."""
    seed(cenv, busy=1, idle=0, lost=0, name="cli-approve")
    snap = take_snapshot(cenv.conn)
    dlq = [  # every reason a step may die of: a line far wider than 80 columns
        {"reason": r, "steps": 12345, "newest": snap.taken_at}
        for r in ("error", "timeout", "crashed", "lease_expired", "deadline", "max_wait",
                  "child_failed", "too_many_items")
    ]  # fmt: skip
    snap = dataclasses.replace(snap, dlq=dlq)
    problem = (
        'cannot read the database: connection to server at "db.internal.example", port 5432 '
        "failed: FATAL: remaining connection slots are reserved for roles with the SUPERUSER "
        "attribute"
    )
    out = Console(file=io.StringIO(), width=80, height=1000, highlight=False)
    out.print(render(snap, problem=problem, width=80, height=None))
    lines = out.file.getvalue().splitlines()
    text = " ".join(" ".join(lines).split())
    assert max(len(line) for line in lines) <= 80
    assert not [line for line in lines if "…" in line and ("DLQ" in line or "by reason" in line)]
    assert problem in text
    assert "too_many_items 12345" in text and "error 12345" in text


def test_the_wide_view_shows_an_empty_section_as_one_line(cenv):
    """No `- none - -` row under a section's heading: it reads as a row with a run."""
    out = Console(file=io.StringIO(), width=200, height=1000, highlight=False)
    out.print(render(take_snapshot(cenv.conn), width=200, height=None))
    text = out.file.getvalue()
    assert "Paused runs  none" in text and "Recent deadline failures  none" in text
    assert not re.search(r"^\s*-\s+none\b", text, re.M), text


def test_status_once_at_80_columns_folds_nothing(capsys, cenv, monkeypatch):
    seeded = seed(cenv, busy=3, idle=2, lost=1)
    monkeypatch.setenv("COLUMNS", "80")
    r = run_cli(capsys, cenv, "status", "--once")
    assert r.code == 0
    lines = r.out.splitlines()
    assert max(len(line) for line in lines) <= 80, r.out
    busy = [line for line in lines if LONG[:10] in line]
    assert len(busy) == 3  # one line per busy worker, with no limit on lines when printed once
    assert str(seeded["killed"]) in r.out


@pytest.mark.parametrize("width", [80, 200])
def test_workers_lists_step_and_run_ids_whole(capsys, cenv, monkeypatch, width):
    seed(cenv, busy=2, idle=1, lost=1, name="cli-approve")
    monkeypatch.setenv("COLUMNS", str(width))
    r = run_cli(capsys, cenv, "workers")
    assert r.code == 0
    data = run_cli(capsys, cenv, "workers", "--json").json()
    busy = [w for w in data["workers"] if w["state"] == "busy"]
    assert len(busy) == 2
    for w in busy:
        assert w["run_id"] in r.out and re.search(rf"(^|\s){w['step_id']}(\s|$)", r.out, re.M)
    for s in data["supervisors"]:
        assert f"{s['host']}:{s['pid']}" in r.out
    wide = [line for line in r.out.splitlines() if len(line) > width]
    assert not wide or "-[ 1 ]" in r.out


@pytest.mark.process
def test_the_live_screen_on_an_80x24_terminal_is_the_compact_one(cenv):
    from pty_helpers import read_until, spawn_on_pty, stop

    seeded = seed(cenv, busy=30, idle=0, lost=1)
    # The size a terminal reports, as on a real 80x24 one: no COLUMNS or LINES to help.
    proc, primary = spawn_on_pty(cenv, "status", "--interval", "500ms", size=(24, 80))
    seen = bytearray()
    try:
        # Two frames: the first and at least one refresh, each ending with the workers count.
        twice = "workers lists all(.|\n)*workers lists all"
        assert read_until(primary, twice, seen, 30), seen[-3000:]
    finally:
        code = stop(proc, primary, seen)
    assert code == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))
    assert "Traceback" not in text and "Workers" not in text  # not the full tables
    assert "queue" in text and str(seeded["killed"]) in text
    frame = text[text.rindex("cyclone status") :].splitlines()
    assert len(frame) <= 24 and max(len(line.rstrip()) for line in frame) <= 80, frame

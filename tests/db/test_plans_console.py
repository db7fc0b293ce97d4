"""The web console's reads cost what a page shows, whatever the history and the statistics.

A history of HISTORY runs (tests/console_history.py: most completed, one in 97 failed with a
dead step, the newest live) on tables never analyzed, analyzed while empty, analyzed with a
tenth of it, or analyzed with all of it, and each console statement explained with the
parameters its page gives it. The console runs every statement unprepared (its sessions never
prepare: prepare_threshold=None), so the custom plan is the one that runs. An unfiltered page
reads the rows it shows; a filtered one at most its window (SCAN rows), never the history.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from console_history import RARE, build_history, history
from plan_probe import Probe, probe

from cyclone.sql import QUERIES
from cyclone.testing import TestEnv

HISTORY = 30_000
PAGE = 51  # a page asks for one row more than it shows
SCAN = 2_000  # the window a filtered page walks (reads.SCAN is 20,000; smaller here, to see it)
# Buffers an unfiltered page or a lookup may touch: index descents, the rows shown and their
# runs' or steps' lookups. A plan that reads the history touches thousands.
BOUND = 400
STATES = ["never_analyzed", "analyzed_empty", "analyzed_small", "analyzed"]


@dataclass
class History:
    env: TestEnv
    state: str
    failed_run: str
    failed_step: int
    middle: Any  # a cursor half-way through the history


@pytest.fixture(scope="module", params=STATES)
def past(request: pytest.FixtureRequest, pg_dsn: str) -> Iterator[History]:
    with TestEnv(workflows=[history], dsn=pg_dsn) as env:
        for table in ("cyclone_steps", "cyclone_runs", "cyclone_step_attempts"):
            env.conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
        if request.param == "analyzed_empty":
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs, cyclone_step_attempts")
        if request.param == "analyzed_small":
            # Statistics of a tenth of the history: the rest came after them.
            build_history(env.conn, HISTORY, first=HISTORY - HISTORY // 10)
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs, cyclone_step_attempts")
            build_history(env.conn, HISTORY, upto=HISTORY - HISTORY // 10)
        else:
            build_history(env.conn, HISTORY)
        if request.param == "analyzed":
            env.conn.execute("ANALYZE cyclone_steps, cyclone_runs, cyclone_step_attempts")
        failed = env.conn.execute(
            "SELECT run_id::text, id FROM cyclone_steps WHERE state = 'dead' ORDER BY id LIMIT 1"
        ).fetchone()
        middle = env.conn.execute(
            "SELECT created_at, id::text FROM cyclone_runs ORDER BY created_at OFFSET %s LIMIT 1",
            (HISTORY // 2,),
        ).fetchone()
        yield History(env, request.param, failed["run_id"], failed["id"],
                      (middle["created_at"], middle["id"]))  # fmt: skip


def _runs(h: History, **filters: Any) -> dict[str, Any]:
    base = dict.fromkeys(("state", "workflow", "queue", "ckey", "error", "since", "until"))
    return {**base, "before_at": None, "before_id": None, "limit": PAGE, "scan": SCAN,
            **filters}  # fmt: skip


def _dlq(h: History, **filters: Any) -> dict[str, Any]:
    base = dict.fromkeys(("reason", "workflow", "error", "since"))
    return {**base, "before_at": None, "before_id": None, "limit": PAGE, "scan": SCAN,
            **filters}  # fmt: skip


# (statement, parameters, the most rows any scan may read). Unfiltered: about the page;
# filtered: the window.
CASES: dict[str, tuple[str, Callable[[History], dict[str, Any]], int]] = {
    "runs_newest": ("console_runs", lambda h: _runs(h), 2 * PAGE),
    "runs_deep_page": (
        "console_runs",
        lambda h: _runs(h, before_at=h.middle[0], before_id=h.middle[1]),
        2 * PAGE,
    ),
    "runs_failed": ("console_runs", lambda h: _runs(h, state="failed"), SCAN + PAGE),
    "runs_rare_workflow": ("console_runs", lambda h: _runs(h, workflow=RARE), SCAN + PAGE),
    "runs_error_text": ("console_runs", lambda h: _runs(h, error="on order 97"), SCAN + PAGE),
    "runs_key": ("console_runs", lambda h: _runs(h, ckey="tenant-3", queue="default"), SCAN + PAGE),
    "runs_boundary": ("console_runs_boundary", lambda h: _runs(h, state="failed"), SCAN + 1),
    "run": ("console_run", lambda h: {"run_id": h.failed_run}, PAGE),
    "run_steps": ("console_run_steps", lambda h: {"run_id": h.failed_run, "limit": 200}, PAGE),
    "run_children": ("console_run_children", lambda h: {"run_id": h.failed_run, "limit": 50}, PAGE),
    "run_attempts": (
        "console_step_attempts",
        lambda h: {"step_ids": [h.failed_step], "limit": 2000},
        PAGE,
    ),
    "dlq_newest": ("console_dlq", lambda h: _dlq(h), 2 * PAGE),
    "dlq_reason": ("console_dlq", lambda h: _dlq(h, reason="timeout"), 2 * PAGE),  # a seek
    "dlq_error_text": ("console_dlq", lambda h: _dlq(h, error="crashed on order"), SCAN + PAGE),
    "dlq_boundary": ("console_dlq_boundary", lambda h: _dlq(h, reason="timeout"), SCAN + 1),
    "workflows": ("console_workflows", lambda h: {"limit": 200}, PAGE),
    # Live runs, counted up to its cap: the live ones (2,000 here), never the history.
    "queue_use": ("console_queue_use", lambda h: {"cap": 100_000}, 2_000 + PAGE),
}


# Every console read of console.sql runs after console_walk, in its transaction
# (cyclone/console/reads.py); console_workflows and console_queue_use too (the limits page).


def _probe(h: History, name: str, params: dict[str, Any]) -> Probe:
    conn = h.env.conn
    with conn.transaction():
        conn.execute(QUERIES["console_walk"], {"local": False})
    try:
        return probe(conn, name, params, "custom")
    finally:
        for setting in ("enable_sort", "enable_bitmapscan", "enable_hashjoin", "enable_seqscan"):
            conn.execute(f"RESET {setting}")


@pytest.mark.parametrize("case", CASES)
def test_a_console_read_costs_its_page_or_its_window_never_the_history(past: History, case):
    name, params, rows = CASES[case]
    result = _probe(past, name, params(past))
    assert result.scanned_rows() <= rows, _explain(past, case, result)
    assert result.sorted_rows() <= max(rows, 500), _explain(past, case, result)
    # Buffers: a heap page or two per row read (the window's rows are spread over the table).
    assert result.buffers <= BOUND + 2 * rows, _explain(past, case, result)


def test_the_window_is_what_bounds_a_filter_that_matches_nothing(past: History):
    """A filter no run matches reads one window, not the history: with the window as large
    as the history, the same statement reads it all (the bound above is the window's)."""
    params = _runs(past, workflow="no-such-workflow")
    small = _probe(past, "console_runs", params)
    whole = _probe(past, "console_runs", {**params, "scan": HISTORY * 2})
    assert small.scanned_rows() <= SCAN
    assert whole.scanned_rows() >= HISTORY


def _explain(h: History, case: str, result: Probe) -> str:
    return (
        f"{case} ({h.state}) read {result.scanned_rows()} rows, {result.buffers} buffers, "
        f"on {HISTORY:,} runs:\n{result.text}"
    )

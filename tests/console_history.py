"""A large history of runs made in a few statements (generate_series), for the console's plan
tests and bench/console.py. No tests here.

`build_history(conn, n)` writes `n` runs created over the last 30 days (oldest first), each
with one step, as a busy deployment leaves them: most completed, FAILED_EVERY-th failed with a
dead step and its attempt (errors of a few kinds, each with its own text), some cancelled, the
newest LIVE running. Workflows, queues and concurrency keys vary. Rows are written with the
row-rule triggers off (session_replication_role = replica, which needs a superuser, as the
embedded test server's is): they hold the rules by construction, and the triggers would only
make a 10-million-run history slower to write.
"""

from __future__ import annotations

from typing import Any

import cyclone

history = cyclone.Workflow("console-history")


@history.task(max_attempts=3)
def work(ctx):
    return None


WORKFLOWS = 20  # console-history-0 .. 19 (one graph: the names vary, not the shape)
FAILED_EVERY = 97  # a run in 97 failed
CANCELLED_EVERY = 211
RARE = "console-history-rare"  # one run in RARE_EVERY has this workflow
RARE_EVERY = 50_000
LIVE = 2_000
REASONS = ["error", "timeout", "crashed", "deadline"]
BATCH = 1_000_000


def build_history(
    conn: Any, n: int, *, live: int = LIVE, first: int = 0, upto: int | None = None
) -> dict[str, Any]:
    """Write runs `first` to `upto - 1` (default: `n - 1`) of a history of `n`, so that a
    history can be written in parts, statistics taken in between; returns the graph hash."""
    graph = conn.execute(
        "SELECT graph_hash FROM cyclone_workflows WHERE name = %s", (history.name,)
    ).fetchone()
    assert graph is not None, "register console_history.history first"
    conn.execute("SET session_replication_role = replica")
    try:
        end = n if upto is None else upto
        for start in range(first, end, BATCH):
            _batch(conn, graph["graph_hash"], start, min(end, start + BATCH), n, live)
    finally:
        conn.execute("SET session_replication_role = DEFAULT")
    return {"graph_hash": graph["graph_hash"]}


def _batch(conn: Any, graph_hash: str, lo: int, hi: int, n: int, live: int) -> None:
    params = {
        "lo": lo, "hi": hi - 1, "n": n, "live": live, "hash": graph_hash,
        "failed": FAILED_EVERY, "cancelled": CANCELLED_EVERY, "rare": RARE,
        "rare_every": RARE_EVERY, "workflows": WORKFLOWS, "reasons": REASONS,
    }  # fmt: skip
    # Run i: created 30 days ago + i/n of them; its state from i; its id a function of i (so
    # that the steps below find their run without a join).
    conn.execute(
        """
        CREATE TEMP TABLE IF NOT EXISTS history_batch (
            i bigint, id uuid, workflow text, state text, created_at timestamptz,
            finished_at timestamptz, reason text)
        """
    )
    conn.execute("TRUNCATE history_batch")
    conn.execute(
        """
        INSERT INTO history_batch
        SELECT i, md5('run' || i)::uuid,
               CASE WHEN i %% %(rare_every)s = 7 THEN %(rare)s
                    ELSE 'console-history-' || (i %% %(workflows)s) END,
               CASE WHEN i >= %(n)s - %(live)s THEN 'running'
                    WHEN i %% %(failed)s = 0 THEN 'failed'
                    WHEN i %% %(cancelled)s = 0 THEN 'cancelled'
                    ELSE 'completed' END,
               now() - interval '30 days' + (i * interval '30 days' / %(n)s),
               NULL, (%(reasons)s::text[])[1 + (i / %(failed)s) %% 4]
          FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i
        """,
        params,
    )
    conn.execute(
        """
        UPDATE history_batch
           SET finished_at = created_at + interval '2 seconds'
         WHERE state <> 'running'
        """
    )
    conn.execute(
        """
        INSERT INTO cyclone_runs (id, workflow, graph_hash, state, input, created_at,
                                  finished_at, queue, priority, pass, concurrency_key)
        SELECT b.id, b.workflow, %(hash)s, b.state, jsonb_build_object('i', b.i),
               b.created_at, b.finished_at,
               (ARRAY['default', 'emails', 'reports'])[1 + b.i %% 3], 1 + b.i %% 5,
               CASE WHEN b.state = 'running' THEN b.i + 1 ELSE -(b.i + 1) END,
               CASE WHEN b.i %% 10 = 3 THEN 'tenant-' || (b.i %% 1000) END
          FROM history_batch b
        """,
        params,
    )
    conn.execute(
        """
        INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, attempt, max_attempts,
                                   available_at, created_at, started_at, completed_at, output,
                                   error, error_kind)
        SELECT b.id, b.workflow, 'work', 'task',
               CASE b.state WHEN 'running' THEN 'available' WHEN 'failed' THEN 'dead'
                            WHEN 'cancelled' THEN 'discarded' ELSE 'completed' END,
               CASE WHEN b.state = 'running' THEN 0 ELSE 1 END, 3,
               b.created_at, b.created_at,
               CASE WHEN b.state <> 'running' THEN b.created_at + interval '1 second' END,
               b.finished_at,
               CASE WHEN b.state = 'completed' THEN 'null'::jsonb END,
               CASE b.state
                    WHEN 'failed' THEN CASE b.reason
                        WHEN 'deadline' THEN 'run deadline exceeded'
                        ELSE 'RuntimeError: upstream ' || b.reason || ' on order ' || b.i
                             || E'\nTraceback (most recent call last):\n  File "app.py"' END
                    WHEN 'cancelled' THEN 'run cancelled' END,
               CASE b.state WHEN 'failed' THEN b.reason WHEN 'cancelled' THEN 'cancelled' END
          FROM history_batch b
        """,
        params,
    )
    conn.execute(
        """
        INSERT INTO cyclone_step_attempts (step_id, run_id, attempt, error_kind, error, worker,
                                           started_at, ended_at)
        SELECT s.id, s.run_id, 1, s.error_kind, s.error, 'vm-1:42', s.started_at, s.completed_at
          FROM cyclone_steps s JOIN history_batch b ON b.id = s.run_id
         WHERE b.state = 'failed'
        """
    )

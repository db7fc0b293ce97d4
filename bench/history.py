"""A history of 10,000,000 runs against an empty one (issue 25). Prints figures.

    python bench/history.py [--history 10000000] [--steps 10000] [--reps 2] [--workers 4]
                            [--dsn DSN]

Two schemas on one server, built alike: the plan tests' backlog (tests/db/test_plans.py, state
"analyzed": 20,000 one-step runs available and 5,200 of other shapes, a 2,000-item map, queued
and paused runs), one with an empty history and one whose history holds `--history` finished
one-step runs, each with its step (one in twenty with a failed attempt too), written by SQL in
batches and spread over the partitions of a week's retention, as a week of drains leaves them.
Autovacuum is left to itself on history, as on a user's server.

Then, on both:
  - every statement of the plan tests under EXPLAIN (ANALYZE, BUFFERS), custom and generic
    plans, in transactions rolled back: buffers and execution time. The hot path (lease,
    completion, dispatch) never reads history; the readers that fall through to it (run_get,
    run_list, run_steps...) and the history sweep do, and must stay O(1) in its size;
  - `--reps` drains of `--steps` one-step runs submitted through the public API, alternating
    between the two schemas, by a real `cyclone-supervisor` whose history sweep moves each run
    a second after it ends (into the big partitions on one side): steps/s and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # plan_probe.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "db"))

import test_plans
from churn import CONFIG
from launch import Supervisor
from plan_probe import probe
from runtime import bench_1step

from cyclone import Client
from cyclone.testing import TestEnv, server_dsn

RETENTION = 7 * 86400.0
BATCH = 250_000

# `n` finished one-step runs ending one after another from `lo`, `gap` apart, with their steps
# and, for one in twenty, a failed first attempt. Step and attempt ids are negative: they
# never meet the hot tables' sequences.
FILL = """
WITH runs AS (
    INSERT INTO cyclone_history_runs
           (id, workflow, graph_hash, state, input, output, created_at, finished_at, queue,
            priority, pass, run_ended_at)
    SELECT gen_random_uuid(), %(workflow)s, %(graph)s, 'completed', 'null', 'null',
           t - interval '40 ms', t, 'default', 3, 0, t
      FROM (SELECT %(lo)s::timestamptz + i * %(gap)s * interval '1 second' AS t, i
              FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i) AS g
    RETURNING id, created_at, run_ended_at
), numbered AS (
    SELECT id, created_at, run_ended_at,
           -(%(first)s::bigint + row_number() OVER ()) AS step_id FROM runs
), steps AS (
    INSERT INTO cyclone_history_steps
           (id, run_id, workflow, node, kind, state, attempt, max_attempts, available_at,
            leased_by, output, created_at, started_at, completed_at, priority, pass,
            run_ended_at)
    SELECT step_id, id, %(workflow)s, %(node)s, 'task', 'completed', 1, 3, created_at,
           'bench-1', 'null', created_at, created_at + interval '10 ms', run_ended_at, 3, 0,
           run_ended_at
      FROM numbered
    RETURNING id, run_id, started_at, run_ended_at
)
INSERT INTO cyclone_history_attempts
       (id, step_id, run_id, attempt, error_kind, error, worker, started_at, ended_at,
        run_ended_at)
SELECT id, id, run_id, 1, 'error', 'ValueError: bench', 'bench-1', started_at,
       started_at + interval '5 ms', run_ended_at
  FROM steps WHERE id %% 20 = 0
"""
SIZE = """
SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint AS bytes
  FROM pg_partition_tree(to_regclass(%(t)s)) WHERE isleaf
"""
LIVE = "SELECT count(*) AS n FROM cyclone_runs WHERE workflow = %s AND state = 'running'"


class _Request:
    def __init__(self, param: str) -> None:
        self.param = param


def fill_history(env: TestEnv, total: int) -> float:
    """`total` runs into history, ending over the last six and a half days; seconds it took."""
    start = time.monotonic()
    conn = env.conn
    span = 6.5 * 86400
    gap = span / max(total, 1)
    lo = conn.execute("SELECT now() - make_interval(secs => %s) AS lo", (span + 600,)).fetchone()[
        "lo"
    ]
    conn.execute("SELECT cyclone_history_ensure(%s, %s, now())", (RETENTION, lo))
    conn.commit()
    node = next(iter(bench_1step.graph.nodes))
    for first in range(0, total, BATCH):
        last = min(first + BATCH, total) - 1
        conn.execute(FILL, {
            "workflow": bench_1step.name, "graph": bench_1step.graph.hash, "node": node,
            "lo": lo, "gap": gap, "first": first, "last": last,
        })  # fmt: skip
        conn.commit()
        print(f"  history: {last + 1:,} runs", end="\r", flush=True)
    print()
    return time.monotonic() - start


def probes(b: Any) -> dict[str, tuple[int, float]]:
    """Each plan-test statement: (buffers, ms), the worse of the custom and generic plans."""
    out: dict[str, tuple[int, float]] = {}
    for name, params in test_plans.STATEMENTS.items():
        modes = ["custom"] if name in test_plans.UNPREPARED else ["custom", "generic"]
        worst = (0, 0.0)
        for mode in modes:
            t0 = time.perf_counter()
            buffers = probe(b.env.conn, name, params(b), mode).buffers
            worst = max(worst, (buffers, (time.perf_counter() - t0) * 1000))
        out[name] = worst
    return out


def fresh_leases(b: Any) -> None:
    """Fresh leases for the probes (those the fixture took may be near their lease's end)."""
    b.leases = {k: b.lease(wf) for k, wf in (
        ("one", test_plans.one), ("chain", test_plans.chain), ("map", test_plans.fanout),
        ("child", test_plans.parent),
    )}  # fmt: skip


def drain(env: TestEnv, steps: int, workers: int) -> float:
    """Steps/s of a supervisor draining `steps` one-step runs submitted through the API."""
    with Client(env.dsn) as client:
        for first in range(0, steps, 1000):
            client.submit_many(bench_1step, [None] * min(1000, steps - first))
    config = CONFIG.format(workers=workers, retention=RETENTION, history_after=1)
    with tempfile.TemporaryDirectory() as tmp:
        sup = Supervisor(env.dsn, Path(tmp), config)
        t0 = time.monotonic()
        try:
            while True:
                left = env.conn.execute(LIVE, (bench_1step.name,)).fetchone()["n"]
                env.conn.commit()
                if left == 0:
                    break
                if sup.popen.poll() is not None:
                    raise RuntimeError(sup.log_path.read_text()[-3000:])
                time.sleep(0.05)
            took = time.monotonic() - t0
        finally:
            sup.stop()
    return steps / took


def history_bytes(env: TestEnv) -> int:
    conn = env.conn
    total = sum(
        conn.execute(SIZE, {"t": t}).fetchone()["bytes"]
        for t in ("cyclone_history_runs", "cyclone_history_steps", "cyclone_history_attempts")
    )
    conn.commit()
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    base = args.dsn or server_dsn()
    fixtures = [test_plans.backlog.__wrapped__(_Request("analyzed"), base) for _ in range(2)]  # type: ignore[attr-defined]
    empty, big = (next(f) for f in fixtures)
    try:
        for b in (empty, big):
            b.env.register(bench_1step)
            # The plan tests turn autovacuum off to build their states; drains get it back.
            for table in ("cyclone_steps", "cyclone_runs"):
                b.env.conn.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")
            b.env.conn.commit()
        print(f"filling history with {args.history:,} runs")
        took = fill_history(big.env, args.history)
        mib = history_bytes(big.env) / 2**20
        print(f"  {took:.0f}s; history {mib:,.0f} MiB on disk (tables, indexes, TOAST)")
        plans = {}
        for label, b in (("empty", empty), ("big", big)):
            fresh_leases(b)
            plans[label] = probes(b)
            b.env.conn.commit()
        print(f"\nplan-test statements, worse of custom and generic: buffers, ms "
              f"(empty history | {args.history:,} in history)")  # fmt: skip
        width = max(len(n) for n in plans["empty"])
        grew = []
        for name, (buf, ms) in plans["empty"].items():
            buf2, ms2 = plans["big"][name]
            flag = ""
            if buf2 > max(buf * 1.5, buf + 20):
                flag = "  <- grew"
                grew.append(name)
            print(f"  {name:<{width}} {buf:>8,} {ms:>8.1f} | {buf2:>8,} {ms2:>8.1f}{flag}")
        print(f"statements whose buffers grew with history: {', '.join(grew) or 'none'}")
        rates: dict[str, list[float]] = {"empty": [], "big": []}
        print(f"\ndrains of {args.steps:,} one-step runs, {args.workers} workers, alternating")
        for rep in range(args.reps):
            order = (("empty", empty), ("big", big))
            for label, b in order if rep % 2 == 0 else order[::-1]:
                rate = drain(b.env, args.steps, args.workers)
                rates[label].append(rate)
                print(f"  rep {rep + 1} {label:5s} history: {rate:,.0f} steps/s", flush=True)
        e, g = statistics.median(rates["empty"]), statistics.median(rates["big"])
        print(f"median: empty {e:,.0f}, {args.history:,} in history {g:,.0f} steps/s; "
              f"ratio {g / e:.2f}")  # fmt: skip
    finally:
        for f in fixtures:
            next(f, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

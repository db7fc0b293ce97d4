"""Bursts as users make them: does a big backlog drain as fast as a small one? Prints figures.

    python bench/backlog.py [--sizes 1000,10000,100000] [--shapes 1,5,map] [--workers 4]
                            [--stale 1000000,200000] [--dispatch true|false] [--dsn DSN]

For each shape and size: a fresh schema (never analyzed, autovacuum left as it is), runs
submitted through `Client.submit_many` in batches of 1,000 (timed: runs/s), then a real
`cyclone-supervisor` with `--workers` workers started on them, timed from its READY=1 to the
last run's `finished_at` on the database clock. Nothing is vacuumed or analyzed by the bench:
what a user who submits a burst and starts the supervisor gets. Shapes: `1` and `5` are no-op
chains of that many steps (one run each), `map` is one task fanning out to 1,000 no-op items
(a size counts steps, so size / 1,001 runs); `keyed` and `declared` are runtime.py's
flow-controlled one-step workflows (a Concurrency limit of 1 over 100 keys; limits that
never bind).

`--stale H,B`: the burst after a quiet period. H steps of finished history are made (submitted,
then marked completed in one statement, as a drained queue leaves them) and analyzed with the
queue empty, as autovacuum would on an idle system; then B one-step runs are submitted and
drained. Reported beside the fresh burst of the same size for comparison.

The figure to read is the ratio of the largest burst's steps/s to the smallest's: 1.0 means a
backlog costs nothing per step. Target: >= 0.7.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine import SHAPES, revision
from runtime import (
    ANY_ACTIVE,
    FLOW_KEYS,
    FLOWS,
    LAST_FINISH,
    Supervisor,
    clock_offset,
    scalar,
)

import cyclone
from cyclone.clients.client import Client
from cyclone.testing import TestEnv, server_dsn

BATCH = 1000
DISPATCH = "true"  # [supervisor] dispatch of the supervisors started (--dispatch)
MAP_ITEMS = 1000


def _noop(ctx: cyclone.StepContext) -> None:
    return None


def _items(ctx: cyclone.StepContext) -> list[int]:
    return list(range(MAP_ITEMS))


bench_map = cyclone.Workflow("bench-map")
_fan = bench_map.map(items=_items, name="fan")(_noop)
bench_map.task(name="after", after=[_fan])(_noop)


def workflow(shape: str) -> tuple[cyclone.Workflow, int]:
    """The workflow of a shape and its steps per run."""
    if shape == "map":
        return bench_map, MAP_ITEMS + 1
    if shape in ("keyed", "declared"):
        return FLOWS[shape], 1
    return SHAPES[int(shape)], int(shape)


def submit(env: TestEnv, wf: cyclone.Workflow, runs: int) -> float:
    """Submit `runs` runs through the public API; returns runs/s."""
    start = time.perf_counter()
    with Client(env.dsn) as client:
        client.set_rate_limit("bench-unbound", rate=1e9, per=1.0, burst=1e9)
        for first in range(0, runs, BATCH):
            n = min(BATCH, runs - first)
            # The flow shapes' key (FLOW_KEYS keys in turn); the others' input stays null.
            keyed = wf in FLOWS.values()
            client.submit_many(
                wf, [{"k": (first + i) % FLOW_KEYS} if keyed else None for i in range(n)]
            )
    return runs / (time.perf_counter() - start)


def history(env: TestEnv, steps: int) -> None:
    """`steps` finished one-step runs, analyzed with nothing in the queue."""
    wf = SHAPES[1]
    with Client(env.dsn) as client:
        for first in range(0, steps, 10 * BATCH):
            client.submit_many(wf, [None] * min(10 * BATCH, steps - first))
    env.conn.execute(
        "UPDATE cyclone_steps SET state = 'completed', completed_at = now(), attempt = 1"
    )
    env.conn.execute("UPDATE cyclone_runs SET state = 'completed', finished_at = now()")
    env.conn.execute("ANALYZE cyclone_runs, cyclone_steps")


# Progress, cheaply: the rows cyclone_steps has had written, from the statistics the backends
# flush about once a second (a 5-step burst completes no run until most of its steps ran).
WRITES = (
    "SELECT n_tup_upd + n_tup_ins FROM pg_stat_user_tables"
    " WHERE schemaname = current_schema() AND relname = 'cyclone_steps'"
)


def wait_drained(env: TestEnv, sup: Supervisor, stall: float = 60.0) -> None:
    """Poll until no run is live; fail loudly if the supervisor died or writes stop."""
    last, since = -1, time.monotonic()
    while scalar(env, ANY_ACTIVE):
        env.conn.execute("SELECT pg_stat_clear_snapshot()")
        writes, now = scalar(env, WRITES), time.monotonic()
        if writes != last:
            last, since = writes, now
        if sup.popen.poll() is not None or now - since > stall:
            tail = sup.log()[-3000:]
            raise RuntimeError(f"no progress; supervisor log:\n{tail}")
        time.sleep(0.2)


def drain(base: str, shape: str, size: int, workers: int, stale: int = 0) -> dict[str, Any]:
    wf, per_run = workflow(shape)
    runs = max(1, size // per_run)
    with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
        env.register(wf)
        if stale:
            history(env, stale)
        submit_rate = submit(env, wf, runs)
        offset = clock_offset(env)
        sup = Supervisor(
            env.dsn, Path(tmp), workers, modules='"runtime", "backlog"', dispatch=DISPATCH
        )
        try:
            wait_drained(env, sup)
            failed = scalar(env, "SELECT count(*) FROM cyclone_runs WHERE state <> 'completed'")
            if failed:
                raise RuntimeError(f"{failed} runs did not complete")
            elapsed = scalar(env, LAST_FINISH) - (sup.ready_wall + offset)
        finally:
            sup.stop()
        analyzed = scalar(
            env,
            "SELECT coalesce(max(greatest(last_analyze, last_autoanalyze))::text, 'never')"
            " FROM pg_stat_user_tables WHERE schemaname = current_schema()"
            " AND relname IN ('cyclone_steps', 'cyclone_runs')",
        )
    return {
        "shape": shape, "size": size, "runs": runs, "steps": runs * per_run,
        "submit": submit_rate, "rate": runs * per_run / elapsed, "seconds": elapsed,
        "stale": stale, "analyzed": analyzed,
    }  # fmt: skip


def report(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':>6} {'runs':>10} {'steps':>10} {'submit runs/s':>14} {'steps/s':>9}"
          f" {'drain s':>8}  stats")  # fmt: skip
    for r in rows:
        label = r["shape"] if not r["stale"] else f"{r['shape']}*"
        stats = "never analyzed" if r["analyzed"] == "never" else "analyzed (autovacuum or --stale)"
        print(f"{label:>6} {r['runs']:>10,} {r['steps']:>10,} {r['submit']:>14,.0f}"
              f" {r['rate']:>9,.0f} {r['seconds']:>8.1f}  {stats}")  # fmt: skip
    print("  * after a quiet period: history analyzed with the queue empty, then the burst")
    print("\nratio of the largest burst's steps/s to the smallest's (target >= 0.7):")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        fresh = [r for r in rows if r["shape"] == shape and not r["stale"]]
        if len(fresh) > 1:
            small, large = fresh[0], fresh[-1]
            print(f"  {shape}: {large['rate'] / small['rate']:.2f}"
                  f" ({large['steps']:,} steps against {small['steps']:,})")  # fmt: skip
        for s in (r for r in rows if r["shape"] == shape and r["stale"]):
            small = fresh[0] if fresh else s
            print(f"  {shape} after a quiet period: {s['rate'] / small['rate']:.2f}"
                  f" ({s['steps']:,} steps on {s['stale']:,} of history,"
                  f" against {small['steps']:,} fresh)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1000,10000,100000", help="steps per burst")
    p.add_argument(
        "--shapes", default="1,5,map",
        help="1, 5, map, and the flow-controlled keyed (Concurrency limit 1 over 100 keys) "
        "and declared (limits that never bind)",
    )  # fmt: skip
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--reps", type=int, default=1, help="drains per size (median reported)")
    p.add_argument("--stale", default="", help="H,B: B runs after H steps of analyzed history")
    p.add_argument("--dispatch", default="true", choices=("true", "false"),
                   help="[supervisor] dispatch (default true)")  # fmt: skip
    p.add_argument("--dsn", help="server to use (default: the embedded test server)")
    args = p.parse_args(argv)
    global DISPATCH
    DISPATCH = args.dispatch
    base = args.dsn or server_dsn()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"cyclone {revision()}, {args.workers} workers, bursts of {sizes} steps", flush=True)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        for size in sizes:
            if shape == "map" and size < MAP_ITEMS + 1:
                continue
            reps = [drain(base, shape, size, args.workers) for _ in range(args.reps)]
            row = sorted(reps, key=lambda r: r["rate"])[len(reps) // 2]
            row["rate"] = statistics.median(r["rate"] for r in reps)
            rows.append(row)
            print(f"  {shape} x {row['runs']:,} runs: submit {row['submit']:,.0f} runs/s,"
                  f" drain {row['rate']:,.0f} steps/s", flush=True)  # fmt: skip
    if args.stale:
        hist, burst = (int(x) for x in args.stale.split(","))
        row = drain(base, "1", burst, args.workers, stale=hist)
        rows.append(row)
        print(f"  1 x {burst:,} runs after {hist:,} of history: drain {row['rate']:,.0f}"
              " steps/s", flush=True)  # fmt: skip
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

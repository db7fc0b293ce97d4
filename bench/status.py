"""Benchmark: `cyclone status --once` on 100,000 runs and 10,000 dead steps.

    python bench/status.py [--runs 100000] [--dead 10000] [--repeat 7]

Seeds an isolated TestEnv schema (submit_many, then SQL updates: dead steps with a mix of
reasons and their runs failed, some runs paused, ten supervisors with eight workers each),
then times, each `--repeat` times and reports the median:

- the whole command as an operator runs it (`cyclone --dsn ... status --once`, a new Python
  process: interpreter start-up and imports included), stdout to a pipe;
- the same in-process (snapshot + render), and each status query alone.

Target: the command under 500 ms.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import cyclone
from cyclone.sql import QUERIES
from cyclone.testing import TestEnv

bench = cyclone.Workflow("bench-status")


@bench.task()
def work(ctx):
    return None


REASONS = ["error", "timeout", "crashed", "lease_expired", "deadline", "max_wait"]


def seed(env: TestEnv, runs: int, dead: int) -> None:
    batch = 10_000
    for start in range(0, runs, batch):
        env.client.submit_many(bench, [{"i": i} for i in range(start, min(runs, start + batch))])
    c = env.conn
    # The first `dead` runs fail: their step is dead with one of the reasons.
    c.execute(
        """
        WITH victims AS (
            SELECT s.id, s.run_id, row_number() OVER (ORDER BY s.id) AS n
              FROM cyclone_steps s ORDER BY s.id LIMIT %(dead)s
        ), steps AS (
            UPDATE cyclone_steps s
               SET state = 'dead', attempt = 1, completed_at = now() - (v.n || ' s')::interval,
                   error_kind = (%(reasons)s::text[])[1 + v.n %% %(nreasons)s],
                   error = 'bench failure ' || v.n
              FROM victims v WHERE s.id = v.id
        )
        UPDATE cyclone_runs r SET state = 'failed', finished_at = now()
          FROM victims v WHERE r.id = v.run_id
        """,
        {"dead": dead, "reasons": REASONS, "nreasons": len(REASONS)},
    )
    # Half of the rest completed, a few hundred paused with a deadline, the others running.
    c.execute(
        """
        WITH live AS (
            SELECT id, row_number() OVER (ORDER BY created_at) AS n FROM cyclone_runs
             WHERE state = 'running'
        ), done AS (
            UPDATE cyclone_steps s SET state = 'completed', attempt = 1, completed_at = now(),
                                       output = 'null'
              FROM live WHERE s.run_id = live.id AND live.n % 2 = 0
        )
        UPDATE cyclone_runs r
           SET state = CASE WHEN live.n % 2 = 0 THEN 'completed' ELSE 'paused' END,
               finished_at = CASE WHEN live.n % 2 = 0 THEN now() END,
               paused_at = CASE WHEN live.n % 2 = 1 THEN now() END,
               deadline_at = CASE WHEN live.n % 2 = 1 THEN now() + interval '1 hour' END
          FROM live
         WHERE r.id = live.id AND (live.n % 2 = 0 OR live.n % 200 = 1)
        """
    )
    for sup in range(10):
        c.execute(
            "INSERT INTO cyclone_supervisors (id, host, pid, workers_target)"
            " VALUES (%s, %s, %s, 8)",
            (f"sup-{sup}", f"vm-{sup}", 1000 + sup),
        )
        c.execute(
            """
            INSERT INTO cyclone_workers (supervisor_id, slot, pid, state, step_id, run_id,
                                         workflow, node, attempt, busy_since)
            SELECT %(sup)s, n, %(pid)s + n, 'busy', s.id, s.run_id, s.workflow, s.node, 1,
                   now() - interval '3 seconds'
              FROM generate_series(1, 8) AS n
              JOIN LATERAL (SELECT id, run_id, workflow, node FROM cyclone_steps
                             WHERE state = 'available' ORDER BY id OFFSET %(offset)s + n LIMIT 1)
                   AS s ON true
            """,
            {"sup": f"sup-{sup}", "pid": 2000 + 10 * sup, "offset": sup * 8},
        )
    c.execute("ANALYZE cyclone_runs")
    c.execute("ANALYZE cyclone_steps")


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def report(label: str, samples: list[float]) -> None:
    print(
        f"{label:<44} median {statistics.median(samples):7.1f} ms"
        f"  (min {min(samples):.1f}, max {max(samples):.1f}, n={len(samples)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--dead", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--explain", action="store_true", help="print each status query's plan")
    args = parser.parse_args()
    from cyclone.cli import main as cli
    from cyclone.status import take_snapshot
    from cyclone.status.render import render

    with TestEnv(workflows=[bench]) as env:
        t0 = time.perf_counter()
        seed(env, args.runs, args.dead)
        counts = env.conn.execute(
            "SELECT (SELECT count(*) FROM cyclone_runs) AS runs,"
            " (SELECT count(*) FROM cyclone_steps WHERE state = 'dead') AS dead"
        ).fetchone()
        print(
            f"seeded {counts['runs']} runs, {counts['dead']} dead steps "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        script = Path(sys.executable).parent / "cyclone"
        argv = [str(script), "--dsn", env.dsn, "status", "--once"]
        subprocess.run(argv, check=True, capture_output=True)  # warm the OS caches
        report(
            "cyclone status --once (new process)",
            timed(lambda: subprocess.run(argv, check=True, capture_output=True), args.repeat),
        )
        report(
            "python -c 'import cyclone.cli' (start-up alone)",
            timed(
                lambda: subprocess.run([sys.executable, "-c", "import cyclone.cli"], check=True),
                args.repeat,
            ),
        )

        def in_process() -> None:
            with redirect_stdout(io.StringIO()):
                assert cli(["--dsn", env.dsn, "status", "--once"]) == 0

        report("status --once in-process (connect+query+render)", timed(in_process, args.repeat))
        report("take_snapshot (all queries)", timed(lambda: take_snapshot(env.conn), args.repeat))
        snap = take_snapshot(env.conn)
        report("render to text", timed(lambda: _render_text(render(snap)), args.repeat))
        params = {
            "limit": 10, "window": 3600.0, "cap": 10_000, "served": [], "self_id": None,
            "lost_after": 10.0,
        }  # fmt: skip
        if args.explain:
            for name in sorted(q for q in QUERIES if q.startswith("status_")):
                if name == "status_begin":
                    continue
                plan = env.conn.execute("EXPLAIN (ANALYZE, COSTS OFF) " + QUERIES[name], params)
                print(f"-- {name}")
                print("\n".join(r["QUERY PLAN"] for r in plan.fetchall()))
        for name in sorted(q for q in QUERIES if q.startswith("status_") and q != "status_begin"):
            report(
                f"  {name}",
                timed(lambda name=name: env.conn.execute(QUERIES[name], params).fetchall(), 5),
            )


def _render_text(renderable: object) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()

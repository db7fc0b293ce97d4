"""How long a scrape of /metrics takes with 100,000 runs and 10,000 dead steps in the database.

    python bench/metrics.py [--runs 100000] [--dead 10000] [--reps 20] [--dsn DSN]

Fills a fresh schema through the client (1-step runs), fails `--dead` of them with a dead step
(error kinds spread over deadline, timeout, error, max_wait), completes half of the rest, and
ANALYZEs. Then times (a) the database gauges' query alone, uncached, `--reps` times, and (b)
HTTP scrapes of a real supervisor's /metrics: the first after its cache expired (one query)
and the cached ones. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path

from engine import SHAPES, engine_fill, revision
from runtime import Supervisor

from cyclone.child.session import connect_briefly
from cyclone.supervisor.gauges import CACHE_TTL, DatabaseGauges
from cyclone.testing import TestEnv, server_dsn

# Bulk state changes for the fill only: the product never writes like this.
FAIL = """
WITH picked AS (
    SELECT id, run_id, (ARRAY['deadline', 'timeout', 'error', 'max_wait'])[1 + id %% 4] AS kind
      FROM cyclone_steps ORDER BY id LIMIT %(dead)s
), steps AS (
    UPDATE cyclone_steps s SET state = 'dead', error_kind = picked.kind, error = 'bench',
           completed_at = now()
      FROM picked WHERE s.id = picked.id
)
UPDATE cyclone_runs r SET state = 'failed', finished_at = now() FROM picked
 WHERE r.id = picked.run_id"""
COMPLETE = """
WITH picked AS (
    SELECT id, run_id FROM cyclone_steps WHERE state = 'available'
     ORDER BY id LIMIT %(n)s
), steps AS (
    UPDATE cyclone_steps s SET state = 'completed', attempt = 1, completed_at = now()
      FROM picked WHERE s.id = picked.id
)
UPDATE cyclone_runs r SET state = 'completed', finished_at = now() FROM picked
 WHERE r.id = picked.run_id"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ms(values: list[float]) -> str:
    ordered = sorted(values)
    p50 = statistics.median(ordered) * 1000
    return f"p50 {p50:6.1f} ms  max {ordered[-1] * 1000:6.1f} ms  (n={len(ordered)})"


def scrape(url: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
    return time.perf_counter() - start, body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100_000)
    p.add_argument("--dead", type=int, default=10_000)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dsn", help="server to use (default: the embedded test server)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    print(f"cyclone {revision()}")
    started = time.perf_counter()
    with TestEnv(dsn=args.dsn or server_dsn()) as env:
        engine_fill(env, 1, args.runs)
        env.conn.execute(FAIL, {"dead": args.dead})
        env.conn.execute(COMPLETE, {"n": (args.runs - args.dead) // 2})
        env.conn.execute("VACUUM ANALYZE cyclone_runs, cyclone_steps")
        counts = env.conn.execute(
            "SELECT state, count(*) AS n FROM cyclone_runs GROUP BY state ORDER BY state"
        ).fetchall()
        print(f"filled in {time.perf_counter() - started:.0f}s: "
              + ", ".join(f"{r['n']} {r['state']}" for r in counts))  # fmt: skip
        assert SHAPES  # the workflow the fill used is registered by engine_fill

        gauges = DatabaseGauges(lambda: connect_briefly(env.dsn, 1000), ttl=0)
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            reading = gauges.read()
            times.append(time.perf_counter() - t)
        assert reading.up, "the gauges query failed"
        print(f"gauges query (connect + query, uncached): {ms(times)}")
        print(f"  dlq: {reading.dlq}\n  runs: {reading.runs}")

        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            sup = Supervisor(env.dsn, Path(tmp), 1, port=str(port))
            url = f"http://127.0.0.1:{port}/metrics"
            try:
                first, cached = [], []
                for rep in range(max(3, args.reps // 5)):
                    if rep:
                        time.sleep(CACHE_TTL + 0.1)  # the cache expired: this scrape queries
                    took, body = scrape(url)
                    first.append(took)
                    for _ in range(5):
                        cached.append(scrape(url)[0])
                assert b"cyclone_db_up 1.0" in body
            finally:
                sup.stop()
        print(f"HTTP scrape, cache expired (one query): {ms(first)}")
        print(f"HTTP scrape, cached:                    {ms(cached)}")
        print(f"scrape size {len(body)} bytes")
    print(f"\nTotal time {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

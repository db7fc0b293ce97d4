"""Benchmark: the web console's pages over a large history (issue 28: a page of runs at a
10M-run history in under 200 ms).

    python bench/console.py [--runs 10000000] [--repeat 7] [--keep SCHEMA]

Writes a history of --runs runs (tests/console_history.py: generate_series inserts, most
completed, one in 97 failed with a dead step and its attempt, the newest 2,000 live, 20
workflows and a rare one, three queues, keys on a tenth) into a schema of its own, VACUUM
ANALYZEs it (a history that old has been vacuumed by autovacuum; `--no-vacuum` leaves it as
written, visibility map unset, so index-only scans visit the heap), serves the console from a
thread, and times each page as a browser gets it (an HTTP GET on loopback: the reads, the
rendering, the transfer), `--repeat` times each, reporting the median.

Baseline, measured in the same run: `run_list`, the statement `cyclone runs` sends for its 50
newest runs (no rendering, no HTTP). The ratio says what the page costs beyond that read.
`--keep SCHEMA` writes the history once into SCHEMA (kept) and reuses it on later runs.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from console_history import RARE, build_history, history
from console_server import serve

from cyclone.db import connect
from cyclone.migrate import migrate
from cyclone.sql import QUERIES
from cyclone.testing import TestEnv, server_dsn


def timed(fn, repeat: int) -> list[float]:
    fn()  # warm: plans, caches, the pool's connection
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def get(base: str, path: str) -> int:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", path)
    res = conn.getresponse()
    body = res.read()
    conn.close()
    assert res.status == 200, (path, res.status, body[:300])
    return len(body)


def report(label: str, samples: list[float], baseline: float | None = None) -> None:
    median = statistics.median(samples)
    ratio = f"  {median / baseline:5.1f}x baseline" if baseline else ""
    print(
        f"{label:<48} median {median:7.1f} ms  (min {min(samples):.1f}, "
        f"max {max(samples):.1f}){ratio}",
        flush=True,
    )


def _kept(dsn: str, schema: str, runs: int) -> str:
    """A DSN on SCHEMA, migrated, holding a history of `runs` runs (written once)."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    kept = make_conninfo(dsn, options=f"-c search_path={schema}")
    with connect(kept) as conn:
        migrate(conn)
        have = conn.execute("SELECT count(*) AS n FROM cyclone_runs").fetchone()["n"]
        if have < runs:
            from cyclone.engine.graphs import register_workflows

            register_workflows(conn, [history])
            t0 = time.perf_counter()
            build_history(conn, runs, first=have)
            print(f"wrote {runs - have:,} runs in {time.perf_counter() - t0:.0f} s", flush=True)
    return kept


def settle(dsn: str, vacuum: bool) -> None:
    t0 = time.perf_counter()
    with connect(dsn) as conn:
        verb = "VACUUM ANALYZE" if vacuum else "ANALYZE"
        conn.execute(f"{verb} cyclone_runs, cyclone_steps, cyclone_step_attempts")
    print(f"{verb} in {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--keep", metavar="SCHEMA", help="write the history once, into SCHEMA")
    parser.add_argument("--no-vacuum", action="store_true", help="ANALYZE only, no VACUUM")
    args = parser.parse_args()
    if args.keep:
        dsn = _kept(server_dsn(), args.keep, args.runs)
        settle(dsn, not args.no_vacuum)
        bench(dsn, args)
        return
    with TestEnv(workflows=[history]) as env:
        t0 = time.perf_counter()
        build_history(env.conn, args.runs)
        print(f"wrote {args.runs:,} runs in {time.perf_counter() - t0:.0f} s", flush=True)
        settle(env.dsn, not args.no_vacuum)
        bench(env.dsn, args)


def bench(dsn: str, args: argparse.Namespace) -> None:
    with connect(dsn) as conn:
        sizes = conn.execute(
            "SELECT (SELECT count(*) FROM cyclone_runs) AS runs,"
            " (SELECT count(*) FROM cyclone_steps WHERE state = 'dead') AS dead,"
            " pg_size_pretty(pg_total_relation_size('cyclone_runs')"
            "   + pg_total_relation_size('cyclone_steps')) AS size"
        ).fetchone()
        print(f"history: {sizes['runs']:,} runs, {sizes['dead']:,} dead steps, {sizes['size']}")
        middle = conn.execute(
            "SELECT created_at, id FROM cyclone_runs ORDER BY created_at DESC, id DESC"
            " OFFSET %s LIMIT 1",
            (sizes["runs"] // 2,),
        ).fetchone()
        failed = conn.execute(
            "SELECT run_id FROM cyclone_steps WHERE state = 'dead'"
            " ORDER BY completed_at DESC LIMIT 1"
        ).fetchone()["run_id"]
        params = {"state": None, "workflow": None, "limit": 50}
        baseline = statistics.median(
            timed(
                lambda: conn.execute(QUERIES["run_list"], params, prepare=False).fetchall(),
                args.repeat,
            )
        )
        print(f"{'baseline: run_list (cyclone runs), 50 newest':<48} median {baseline:7.1f} ms")
    cursor = f"{middle['created_at'].isoformat()}~{middle['id']}".replace("+", "%2B")
    pages = [
        ("/runs (newest 50)", "/runs"),
        ("/runs, a page half-way back", f"/runs?before={cursor}"),
        ("/runs?state=failed", "/runs?state=failed"),
        ("/runs?workflow=<1 run in 50,000>", f"/runs?workflow={RARE}"),
        ("/runs?error=<text of one run>", "/runs?error=on+order+4999962"),
        ("/runs?since=1h&state=running", "/runs?since=1h&state=running"),
        ("/dlq (newest 50)", "/dlq"),
        ("/dlq?reason=timeout", "/dlq?reason=timeout"),
        ("/runs/<failed run>", f"/runs/{failed}"),
        ("/ (overview, live counts)", "/"),
        ("/limits", "/limits"),
    ]
    with serve(dsn) as base:
        for label, path in pages:
            size = get(base, path)
            report(f"{label} [{size // 1024} KiB]", timed(lambda p=path: get(base, p),
                                                          args.repeat), baseline)  # fmt: skip


if __name__ == "__main__":
    main()

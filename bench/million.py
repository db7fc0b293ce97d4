"""Why a backlog of a million drains slower than one of a thousand (issue 25). Prints figures.

    python bench/million.py [--sizes 2000,1000000] [--window 15] [--workers 4] [--dsn DSN]
                            [--pgdata DIR]

For each size: a fresh schema, that many one-step runs submitted through `Client.submit_many`
(nothing analyzed or vacuumed, as a user's burst), then:
  - the sizes of the hot tables and of each of their indexes, against shared_buffers;
  - one lease of the supervisor's candidate scan (`cyclone_lease_candidates`, 8 steps) under
    EXPLAIN (ANALYZE, BUFFERS), rolled back: the buffers it touches, hit and read;
  - a real `cyclone-supervisor` with `--workers` workers draining for `--window` seconds:
    steps/s, and over that window the buffer reads and hits of the hot tables and indexes
    (pg_statio_user_tables / _indexes: a hit is found in shared_buffers, a read comes from the
    OS, which with this machine's memory is its page cache, not a disk), the cache hit ratio,
    and what autovacuum did meanwhile (pg_stat_user_tables, pg_stat_progress_vacuum sampled).
Also, over the window: WAL bytes written per step (pg_current_wal_lsn), and with `--pgdata`
(the server's data directory, on this machine) the CPU seconds its processes spent, so steps
per PostgreSQL core-second.
The figures to read: the steps/s ratio of the largest size to the smallest, the lease's
buffers per step at each size (work that follows the backlog would grow with it), and the
hit ratio and autovacuum time of each window (cache misses and maintenance would show there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from churn import CONFIG
from launch import Supervisor
from runtime import bench_1step

from cyclone import Client
from cyclone.testing import TestEnv, server_dsn

# The churn's supervisor, with history and retention off: nothing leaves the tables.


TABLES = ("cyclone_runs", "cyclone_steps")
SIZES = """
SELECT c.relname, pg_relation_size(c.oid) AS bytes, c.relkind
  FROM pg_class c
 WHERE c.relnamespace = current_schema()::regnamespace
   AND (c.relname IN ('cyclone_runs', 'cyclone_steps')
        OR c.oid IN (SELECT indexrelid FROM pg_index
                      WHERE indrelid IN ('cyclone_runs'::regclass, 'cyclone_steps'::regclass)))
 ORDER BY bytes DESC
"""
STATIO = """
SELECT sum(heap_blks_read) AS heap_read, sum(heap_blks_hit) AS heap_hit,
       sum(idx_blks_read) AS idx_read, sum(idx_blks_hit) AS idx_hit,
       sum(n_tup_upd) AS updates
  FROM pg_statio_user_tables t JOIN pg_stat_user_tables s USING (relid)
 WHERE t.schemaname = current_schema() AND t.relname IN ('cyclone_runs', 'cyclone_steps')
"""
VACUUMS = """
SELECT coalesce(sum(autovacuum_count), 0) AS vacuums,
       coalesce(sum(autoanalyze_count), 0) AS analyzes
  FROM pg_stat_user_tables
 WHERE schemaname = current_schema() AND relname IN ('cyclone_runs', 'cyclone_steps')
"""
VACUUMING = """
SELECT count(*) AS n FROM pg_stat_progress_vacuum p
  JOIN pg_class c ON c.oid = p.relid
 WHERE c.relnamespace = current_schema()::regnamespace
"""
LEASE = (
    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM cyclone_lease_candidates("
    "8, '{}', now(), NULL, NULL, NULL, NULL)"
)
DONE = "SELECT count(*) AS n FROM cyclone_steps WHERE state = 'completed'"
ANY_LEFT = "SELECT EXISTS (SELECT 1 FROM cyclone_runs WHERE state = 'running') AS left"


WAL = "SELECT pg_current_wal_lsn() AS lsn"
WAL_BYTES = "SELECT pg_wal_lsn_diff(%s, %s)::bigint AS bytes"


def server_cpu(pgdata: str | None) -> float:
    """CPU seconds (user + system) of the server's postmaster and its live children."""
    if pgdata is None:
        return 0.0
    return tree_cpu(int(Path(pgdata, "postmaster.pid").read_text().split()[0]))


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live children."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    total = 0
    for p in [pid, *map(int, children)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def one(env: TestEnv, sql: str) -> dict[str, Any]:
    env.conn.execute("SELECT pg_stat_clear_snapshot()")
    return dict(env.conn.execute(sql).fetchone())  # type: ignore[arg-type]


def lease_buffers(env: TestEnv) -> dict[str, int]:
    with env.conn.transaction(force_rollback=True):
        plan = env.conn.execute(LEASE).fetchone()
    top = plan["QUERY PLAN"] if isinstance(plan, dict) else plan[0]
    top = json.loads(top) if isinstance(top, str) else top
    node = top[0]["Plan"]
    return {"hit": node.get("Shared Hit Blocks", 0), "read": node.get("Shared Read Blocks", 0),
            "rows": node.get("Actual Rows", 0)}  # fmt: skip


class VacuumWatch(threading.Thread):
    """Samples pg_stat_progress_vacuum every 100 ms: seconds during which autovacuum worked
    on this schema's tables."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.busy, self.stop = dsn, 0.0, threading.Event()

    def run(self) -> None:
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as conn:
            while not self.stop.wait(0.1):
                if conn.execute(VACUUMING).fetchone()["n"]:
                    self.busy += 0.1


def measure(
    base: str, size: int, workers: int, window: float, pgdata: str | None
) -> dict[str, Any]:
    with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
        env.register(bench_1step)
        start = time.perf_counter()
        with Client(env.dsn) as client:
            for first in range(0, size, 1000):
                client.submit_many(bench_1step, [None] * min(1000, size - first))
        submit_s = time.perf_counter() - start
        sizes = env.conn.execute(SIZES).fetchall()
        shared = env.conn.execute("SELECT setting::bigint * 8192 AS b FROM pg_settings"
                                  " WHERE name = 'shared_buffers'").fetchone()["b"]  # fmt: skip
        lease = lease_buffers(env)
        before, vac_before = one(env, STATIO), one(env, VACUUMS)
        watch = VacuumWatch(env.dsn)
        watch.start()
        sup = Supervisor(
            env.dsn, Path(tmp), CONFIG.format(workers=workers, retention=0, history_after=0)
        )
        wal0, cpu0, sup0 = one(env, WAL)["lsn"], server_cpu(pgdata), tree_cpu(sup.popen.pid)
        t0 = time.monotonic()
        # The window, or less if the backlog drains first (a small one does).
        while (took := time.monotonic() - t0) < window:
            if one(env, ANY_LEFT)["left"] is False:
                break
            time.sleep(0.1)
        done = one(env, DONE)["n"]
        cpu = server_cpu(pgdata) - cpu0
        workers_cpu = tree_cpu(sup.popen.pid) - sup0
        wal = env.conn.execute(WAL_BYTES, (one(env, WAL)["lsn"], wal0)).fetchone()["bytes"]
        # Stopped first: its sessions flush their statistics as they end.
        sup.stop()
        time.sleep(1.5)
        after, vac_after = one(env, STATIO), one(env, VACUUMS)
        lease_late = lease_buffers(env)
        watch.stop.set()
        watch.join()
        delta = {k: int(after[k] or 0) - int(before[k] or 0) for k in after}
        reads = delta["heap_read"] + delta["idx_read"]
        hits = delta["heap_hit"] + delta["idx_hit"]
        return {
            "size": size, "submit_s": submit_s, "steps_s": done / took,
            "sizes": [(r["relname"], r["bytes"]) for r in sizes],
            "hot_bytes": sum(r["bytes"] for r in sizes), "shared_buffers": shared,
            "lease": lease, "lease_after_window": lease_late,
            "reads": reads, "hits": hits, "hit_ratio": hits / max(1, hits + reads),
            "reads_per_step": reads / max(1, done), "hits_per_step": hits / max(1, done),
            "autovacuums": vac_after["vacuums"] - vac_before["vacuums"],
            "autoanalyzes": vac_after["analyzes"] - vac_before["analyzes"],
            "vacuum_busy_s": watch.busy,
            "wal_per_step": wal / max(1, done), "server_cpu_s": cpu,
            "supervisor_cpu_s": workers_cpu, "took_s": took,
            "steps_per_core_s": done / cpu if cpu else None,
        }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2000,1000000")
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--pgdata", default=None, help="the server's data directory")
    args = parser.parse_args()
    base = args.dsn or server_dsn()
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        r = measure(base, size, args.workers, args.window, args.pgdata)
        results.append(r)
        mib = 2**20
        print(f"\n{size:,} runs (submitted in {r['submit_s']:.0f}s): drain {r['steps_s']:,.0f} "
              f"steps/s over the first {args.window:.0f}s")  # fmt: skip
        print(f"  hot tables + indexes {r['hot_bytes'] / mib:,.0f} MiB "
              f"(shared_buffers {r['shared_buffers'] / mib:,.0f} MiB); largest:")  # fmt: skip
        for name, size_b in r["sizes"][:6]:
            print(f"    {name:40s} {size_b / mib:8.1f} MiB")
        print(f"  one lease of 8 (EXPLAIN ANALYZE, BUFFERS): before {r['lease']}, after the "
              f"window {r['lease_after_window']}")  # fmt: skip
        print(f"  window: {r['hits']:,} hits, {r['reads']:,} reads (hit ratio "
              f"{r['hit_ratio']:.3f}); per step {r['hits_per_step']:.1f} hits, "
              f"{r['reads_per_step']:.2f} reads")  # fmt: skip
        print(f"  autovacuum: {r['autovacuums']} vacuums, {r['autoanalyzes']} analyzes, busy "
              f"on these tables {r['vacuum_busy_s']:.1f}s of the window")  # fmt: skip
        per_core = r["steps_per_core_s"]
        print(
            f"  WAL {r['wal_per_step']:,.0f} bytes a step; over {r['took_s']:.1f}s, server CPU "
            f"{r['server_cpu_s']:.1f}s, supervisor and workers {r['supervisor_cpu_s']:.1f}s"
            + (f"; {per_core:,.0f} steps per PostgreSQL core-second" if per_core else "")
        )
    if len(results) > 1:
        print(f"\nratio of steps/s, {results[-1]['size']:,} to {results[0]['size']:,}: "
              f"{results[-1]['steps_s'] / results[0]['steps_s']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

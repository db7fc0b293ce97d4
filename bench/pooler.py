"""The same backlog drained directly and through PgBouncer in transaction mode. Prints figures.

    python bench/pooler.py [--runs 1200] [--shape 5] [--supervisors 2] [--workers 8]
                           [--pool-size 10] [--modes direct,direct-unprepared,pooler]
                           [--timeout 180] [--logs DIR] [--dsn DSN]

Needs `pgbouncer` (Debian: `apt-get install pgbouncer`) and the embedded server (or `--dsn`
naming a server's unix socket). For each mode: a fresh schema in a database only this bench
uses, `--runs` no-op runs of `--shape` steps submitted directly, then `--supervisors` real
`cyclone-supervisor` processes of `--workers` workers each (as many VMs would run) started on
them, timed from the first READY=1 to the last run's `finished_at`.

* direct: the supervisors connect to the server (`[database] prepared_statements = true`,
  the default).
* direct-unprepared: the same with `prepared_statements = false`: what re-planning every
  statement costs, without the pooler.
* pooler: through PgBouncer, `pool_mode = transaction`, `default_pool_size = --pool-size`,
  `ignore_startup_parameters = options`, with `prepared_statements = false`.
* pooler-prepared (only when asked for, with a short `--timeout`): the same with
  `prepared_statements = true`, the failure this bench guards against: counts the errors
  and crashes it causes.

Server connections are sampled from pg_stat_activity every 100 ms during the drain (this
bench's own session left out) and reported at their peak, per application_name for direct
(where each session is one process's); the log lines about prepared statements, crashes and
failed boots are counted from the supervisors' logs.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from engine import SHAPES, bench_database, revision
from launch import Supervisor

from cyclone.clients.client import Client
from cyclone.testing import TestEnv, server_dsn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "process"))
from pgbouncer import PgBouncer, pgbouncer_binary  # noqa: E402

# This module is also the supervisors' workflow module: it registers the Workflow objects
# among its attributes.
bench_1step, bench_5step = SHAPES[1], SHAPES[5]
BATCH = 1000
MODES = ("direct", "direct-unprepared", "pooler", "pooler-prepared")
PREPARED = ("direct", "pooler-prepared")
CONFIG = """
[database]
migrate = false
prepared_statements = {prepared}
[supervisor]
workers = {workers}
max_steps_per_worker = 0
[worker]
poll_interval = "100ms"
[scanner]
interval = "500ms"
[metrics]
enabled = false
[workflows]
modules = ["pooler"]
[logging]
level = "info"
"""
SERVER_SESSIONS = """
SELECT coalesce(application_name, '') AS app, count(*) AS n FROM pg_stat_activity
 WHERE datname = current_database() AND backend_type = 'client backend'
   AND pid <> pg_backend_pid() AND pid <> %s
 GROUP BY 1
"""


def start_supervisor(dsn: str, tmp: Path, name: str, workers: int, prepared: bool) -> Supervisor:
    """Started, not yet waited for: the drain is timed from the first READY=1 of them all."""
    config = CONFIG.format(workers=workers, prepared="true" if prepared else "false")
    return Supervisor(dsn, tmp, config, name, wait=False)


class Sampler(threading.Thread):
    """The peak of server sessions on the bench's database, in total and per application."""

    def __init__(self, dsn: str, exclude: int) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.exclude = exclude
        self.stop = threading.Event()
        self.peak = 0
        self.peak_by_app: dict[str, int] = {}

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.wait(0.1):
                rows = conn.execute(SERVER_SESSIONS, (self.exclude,)).fetchall()
                by_app = {app: n for app, n in rows}
                if sum(by_app.values()) > self.peak:
                    self.peak = sum(by_app.values())
                    self.peak_by_app = by_app


def drain(base: str, mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    wf = SHAPES[args.shape]
    with TestEnv(dsn=base) as env:
        with Client(env.dsn) as client:
            for first in range(0, args.runs, BATCH):
                client.submit_many(wf, [None] * min(BATCH, args.runs - first))
        pooler = None
        dsn = env.dsn
        if mode.startswith("pooler"):
            pooler = PgBouncer(base, pool_size=args.pool_size, search_path=env.schema)
            pooler.start()
            dsn = pooler.dsn()
        sampler = Sampler(base, exclude=env.conn.info.backend_pid)
        sampler.start()
        sups = [
            start_supervisor(dsn, tmp, f"{mode}-{i}", args.workers, prepared=mode in PREPARED)
            for i in range(args.supervisors)
        ]
        try:
            ready = min(s.wait_ready() for s in sups)
            offset = (
                env.conn.execute(
                    "SELECT extract(epoch FROM clock_timestamp())::float8 AS t"
                ).fetchone()["t"]
                - time.time()
            )
            deadline = time.monotonic() + args.timeout
            drained = True
            while env.conn.execute(
                "SELECT EXISTS (SELECT 1 FROM cyclone_runs WHERE state IN ('running', 'paused'))"
                " AS busy"
            ).fetchone()["busy"]:
                if time.monotonic() > deadline:
                    if mode != "pooler-prepared":  # the one expected to fail
                        tail = sups[0].log()[-3000:]
                        raise RuntimeError(f"{mode}: not drained after {args.timeout}s:\n{tail}")
                    drained = False
                    break
                time.sleep(0.1)
            row = env.conn.execute(
                "SELECT extract(epoch FROM max(finished_at))::float8 AS last,"
                " count(*) FILTER (WHERE state = 'completed') AS completed FROM cyclone_runs"
            ).fetchone()
            crashed = env.conn.execute(
                "SELECT count(*) AS n FROM cyclone_steps WHERE error_kind = 'crashed'"
                " OR attempt > 1"
            ).fetchone()["n"]
        finally:
            sampler.stop.set()
            for s in sups:
                s.stop()
            if pooler is not None:
                pooler.close()
        sampler.join()
        logs = "".join(s.log() for s in sups)
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            (Path(args.logs) / f"{mode}.log").write_text(logs)
        steps_s = float("nan")  # not drained: no rate to give
        if drained:
            steps_s = args.runs * args.shape / (row["last"] - (ready + offset))
        return {
            "mode": mode,
            "steps_s": steps_s,
            "completed": row["completed"],
            "retried": crashed,
            "server": sampler.peak,
            "by_app": sampler.peak_by_app,
            "prepared_errors": logs.count("prepared statement"),
            "crashes": logs.count("recorded as crashed"),
            "boot_failures": logs.count("failed to boot"),
        }


def by_app(counts: dict[str, int]) -> str:
    kinds: collections.Counter[str] = collections.Counter()
    for app, n in counts.items():
        kinds["cyclone-worker-N" if app.startswith("cyclone-worker-") else app or "?"] += n
    return ", ".join(f"{app} {n}" for app, n in sorted(kinds.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1200)
    parser.add_argument("--shape", type=int, choices=sorted(SHAPES), default=5)
    parser.add_argument("--supervisors", type=int, default=2)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--pool-size", type=int, default=10)
    parser.add_argument("--modes", default="direct,direct-unprepared,pooler")
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--logs", metavar="DIR", help="keep the supervisors' logs there")
    parser.add_argument("--dsn", help="a server on a unix socket (default: the embedded one)")
    args = parser.parse_args()
    if pgbouncer_binary() is None:
        print("pgbouncer is not installed (Debian: apt-get install pgbouncer)", file=sys.stderr)
        return 2
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: each of {', '.join(MODES)}")
    steps = args.runs * args.shape
    print(f"cyclone {revision()}; {args.supervisors} supervisors x {args.workers} workers, "
          f"{args.runs} runs of {args.shape} no-op steps ({steps} steps) a mode; "
          f"pool size {args.pool_size}")  # fmt: skip
    results = []
    with bench_database(args.dsn or server_dsn(), None) as base:
        for mode in modes:
            with tempfile.TemporaryDirectory() as tmp:
                results.append(drain(base, mode, args, Path(tmp)))
    print(f"{'mode':<18} {'steps/s':>8} {'server conns':>12} {'completed':>9} {'retried':>7} "
          f"{'prep. errors':>12} {'crashes':>7} {'boot fails':>10}")  # fmt: skip
    for r in results:
        print(f"{r['mode']:<18} {r['steps_s']:>8,.0f} {r['server']:>12} {r['completed']:>9} "
              f"{r['retried']:>7} {r['prepared_errors']:>12} {r['crashes']:>7} "
              f"{r['boot_failures']:>10}")  # fmt: skip
    for r in results:
        print(f"peak server sessions, {r['mode']}: {by_app(r['by_app'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Latency: how soon work starts once it can (issue 23). Prints figures.

    python bench/latency.py [--runs 300] [--seconds 10] [--workers 4] [--reps 1]
                            [--only pickup,e2e,signal,child,sleep,retry,load,cost]
                            [--dsn DSN]

A real supervisor (default config but for the workers: poll_interval 1 s, scanner interval
1 s, dispatch on) on a fresh schema, fed through the public API as users feed it. Times are
the database's own (a step's `started_at` against a run's `created_at`, a signal's, a child's
`finished_at`), but for end-to-end, which is the client's wall clock.

* pickup: one-step runs submitted one at a time every 20 ms: submit to step started.
* e2e: `submit` then `Client.result`, one run after another (wall clock).
* signal: a run parked on a wait node gets its signal: signal sent to the next step started.
* child: a parent's child run ends: child's finish to the parent's next step started.
* sleep: a 200 ms sleep: its end (created + 200 ms) to the next step started.
* retry: a step fails once (backoff from 1 s): its backoff's end to the retry started.
* load: pickup at 50% and 90% of the throughput this supervisor just drained at, submitted in
  batches (`submit_many`) every 10 ms.
* cost: the throughput drains of runtime.py (10,000 one-step and 5-step steps, filled then
  drained), with [supervisor] wake on and off, alternating, in one run.

This module is also the supervisor's workflow module (`[workflows] modules = ["latency"]`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import engine
import runtime
from launch import Supervisor as Launched

import cyclone
from cyclone.testing import TestEnv, server_dsn

HERE = Path(__file__).resolve().parent
SLEEP = 0.2


def _noop(ctx: Any) -> None:
    return None


def _fail_once(ctx: Any) -> None:
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails")


lat_noop = cyclone.Workflow("lat_noop")
lat_noop.task(_noop, name="t")
lat_signal = cyclone.Workflow("lat_signal")
lat_signal.wait("go")
lat_signal.task(_noop, name="after", after=["go"])
lat_child = cyclone.Workflow("lat_child")
lat_child.child("c", lat_noop)
lat_child.task(_noop, name="after", after=["c"])
lat_sleep = cyclone.Workflow("lat_sleep")
lat_sleep.sleep("s", timedelta(seconds=SLEEP))
lat_sleep.task(_noop, name="after", after=["s"])
lat_retry = cyclone.Workflow("lat_retry")
lat_retry.task(_fail_once, name="t", max_attempts=2)

CONFIG = """
[database]
migrate = false
[supervisor]
workers = {workers}
wake = {wake}
[metrics]
port = 0
[workflows]
modules = ["latency"]
[logging]
level = "warning"
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def show(name: str, ms: list[float]) -> None:
    if not ms:
        print(f"  {name:<34} no samples")
        return
    print(f"  {name:<34} p50 {pct(ms, 50):7.1f} ms  p99 {pct(ms, 99):7.1f} ms  "
          f"max {max(ms):7.1f} ms  (n={len(ms)})", flush=True)  # fmt: skip


def column(env: TestEnv, sql: str, *params: Any) -> list[float]:
    rows = env.conn.execute(sql, params).fetchall()
    return [float(r["ms"]) for r in rows if r["ms"] is not None]


def wait_for(env: TestEnv, sql: str, count: int, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while env.conn.execute(sql).fetchone()["n"] < count:
        if time.monotonic() > end:
            raise TimeoutError(sql)
        time.sleep(0.05)


def trickle(client: cyclone.Client, wf: cyclone.Workflow, runs: int, every: float) -> list[str]:
    ids, next_at = [], time.monotonic()
    for _ in range(runs):
        ids.append(client.submit(wf, {}))
        next_at += every
        time.sleep(max(0.0, next_at - time.monotonic()))
    return ids


MS = "1000 * extract(epoch FROM {})"


def pickup(env: TestEnv, client: cyclone.Client, runs: int) -> None:
    trickle(client, lat_noop, runs, 0.02)
    wait_for(env, "SELECT count(*) AS n FROM cyclone_runs WHERE workflow = 'lat_noop' AND state = "
                  "'completed' AND parent_run_id IS NULL", runs + 1)  # fmt: skip
    show("pickup, a run every 20 ms", column(env, f"""
        SELECT {MS.format("s.started_at - r.created_at")} AS ms
          FROM cyclone_runs r JOIN cyclone_steps s ON s.run_id = r.id
         WHERE r.workflow = 'lat_noop' AND r.parent_run_id IS NULL"""))  # fmt: skip


def end_to_end(client: cyclone.Client, runs: int) -> None:
    ms = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run_id = client.submit(lat_noop, {})
        client.result(run_id, timeout=30)
        ms.append((time.perf_counter() - t0) * 1000)
    show("submit + result (wall clock)", ms)


def signals(env: TestEnv, client: cyclone.Client, runs: int) -> None:
    ids = [client.submit(lat_signal, {}) for _ in range(runs)]
    wait_for(env, "SELECT count(*) AS n FROM cyclone_steps WHERE workflow = 'lat_signal' "
                  "AND node = 'go' AND state = 'waiting'", runs)  # fmt: skip
    for run_id in ids:
        client.signal(run_id, "go")
        time.sleep(0.02)
    wait_for(env, "SELECT count(*) AS n FROM cyclone_runs WHERE workflow = 'lat_signal' "
                  "AND state = 'completed'", runs)  # fmt: skip
    show("signal to next step", column(env, f"""
        SELECT {MS.format("s.started_at - g.created_at")} AS ms
          FROM cyclone_signals g JOIN cyclone_steps s ON s.run_id = g.run_id
         WHERE s.node = 'after' AND s.workflow = 'lat_signal'"""))  # fmt: skip


def trickled(env: TestEnv, client: cyclone.Client, wf: cyclone.Workflow, runs: int,
             label: str, sql: str, *params: Any) -> None:  # fmt: skip
    """`runs` runs of `wf`, one every 20 ms, then `sql`'s latencies once all completed."""
    trickle(client, wf, runs, 0.02)
    wait_for(env, f"SELECT count(*) AS n FROM cyclone_runs WHERE workflow = '{wf.name}' "
                  "AND state = 'completed'", runs)  # fmt: skip
    show(label, column(env, sql, *params))


def children(env: TestEnv, client: cyclone.Client, runs: int) -> None:
    trickled(env, client, lat_child, runs, "child end to parent's next step", f"""
        SELECT {MS.format("s.started_at - c.finished_at")} AS ms
          FROM cyclone_runs c JOIN cyclone_steps s ON s.run_id = c.parent_run_id
         WHERE s.node = 'after' AND s.workflow = 'lat_child'""")  # fmt: skip


def sleeps(env: TestEnv, client: cyclone.Client, runs: int) -> None:
    trickled(env, client, lat_sleep, runs, f"sleep {SLEEP * 1000:.0f} ms: end to next step", f"""
        SELECT {MS.format("a.started_at - (s.created_at + %s * interval '1 second')")} AS ms
          FROM cyclone_steps s JOIN cyclone_steps a ON a.run_id = s.run_id AND a.node = 'after'
         WHERE s.node = 's' AND s.workflow = 'lat_sleep'""", SLEEP)  # fmt: skip


def retries(env: TestEnv, client: cyclone.Client, runs: int) -> None:
    trickled(env, client, lat_retry, runs, "retry: backoff's end to the retry", f"""
        SELECT {MS.format("started_at - available_at")} AS ms
          FROM cyclone_steps WHERE workflow = 'lat_retry' AND attempt = 2""")  # fmt: skip


def drain_rate(env: TestEnv, client: cyclone.Client, runs: int) -> float:
    """Steps/s of a drain of `runs` one-step runs submitted at once, on the running supervisor."""
    before = env.conn.execute("SELECT count(*) AS n FROM cyclone_runs").fetchone()["n"]
    for start in range(0, runs, 500):
        client.submit_many(lat_noop, [{}] * min(500, runs - start))
    wait_for(env, "SELECT count(*) AS n FROM cyclone_runs WHERE state = 'completed'",
             before + runs)  # fmt: skip
    row = env.conn.execute("""
        SELECT extract(epoch FROM max(s.completed_at) - min(s.started_at)) AS secs
          FROM (SELECT * FROM cyclone_steps ORDER BY id DESC LIMIT %s) s""", (runs,)).fetchone()
    return runs / float(row["secs"])


def load(env: TestEnv, client: cyclone.Client, seconds: float, rate: float, share: float) -> None:
    """Pickup while submitting at `share` of `rate`, in batches every 10 ms."""
    per_tick, tick = rate * share * 0.01, 0.01
    mark = env.conn.execute("SELECT coalesce(max(id), 0) AS id FROM cyclone_steps").fetchone()["id"]
    owed, next_at, end, sent = 0.0, time.monotonic(), time.monotonic() + seconds, 0
    while time.monotonic() < end:
        owed += per_tick
        n = int(owed)
        if n:
            client.submit_many(lat_noop, [{}] * n)
            owed -= n
            sent += n
        next_at += tick
        time.sleep(max(0.0, next_at - time.monotonic()))
    wait_for(env, f"SELECT count(*) AS n FROM cyclone_steps WHERE id > {mark} "
                  "AND state = 'completed'", sent)  # fmt: skip
    show(f"pickup at {share:.0%} ({rate * share:,.0f} runs/s)", column(env, f"""
        SELECT {MS.format("s.started_at - r.created_at")} AS ms
          FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id WHERE s.id > %s""",
        mark))  # fmt: skip


def drain(base: str, shape: int, steps: int, workers: int, wake: str) -> float:
    runs = steps // shape
    with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
        engine.engine_fill(env, shape, runs)
        offset = runtime.clock_offset(env)
        sup = runtime.Supervisor(env.dsn, Path(tmp), workers, wake=wake)
        try:
            runtime.wait_completed(env, sup, runs, 0.2, drained=True)
            last = runtime.scalar(env, runtime.LAST_FINISH)
            elapsed = last - (sup.ready_wall + offset)
        finally:
            sup.stop()
    return runs * shape / elapsed


def cost(base: str, steps: int, workers: int, reps: int) -> None:
    for shape in (1, 5):
        rates: dict[str, list[float]] = {"true": [], "false": []}
        for rep in range(reps):
            for wake in (("false", "true") if rep % 2 else ("true", "false")):
                rates[wake].append(drain(base, shape, steps, workers, wake))
        on, off = statistics.median(rates["true"]), statistics.median(rates["false"])
        print(f"  {shape}-step drain, {workers} workers: wake on {on:,.0f}/s, off {off:,.0f}/s,"
              f" ratio {on / off:.2f}  (reps: on {[round(r) for r in rates['true']]}, "
              f"off {[round(r) for r in rates['false']]})", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=300, help="samples per latency (default 300)")
    p.add_argument("--seconds", type=float, default=10.0, help="load: seconds per rate")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=10000, help="cost: steps per drain")
    p.add_argument("--reps", type=int, default=1, help="cost: drains per side")
    p.add_argument("--wake", default="true", help="[supervisor] wake for the latencies")
    p.add_argument("--only", default="pickup,e2e,signal,child,sleep,retry,load,cost")
    p.add_argument("--dsn", help="server to use (default: the embedded test server)")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    base = args.dsn or server_dsn()
    print(f"latency.py at {engine.revision()}, {args.workers} workers, wake={args.wake}")
    if only - {"cost"}:
        with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
            config = CONFIG.format(workers=args.workers, wake=args.wake)
            sup = Launched(env.dsn, Path(tmp), config)
            try:
                with cyclone.Client(env.dsn) as client:
                    client.submit(lat_noop, {})  # the first connection's costs, not measured
                    time.sleep(1.5)  # past a full poll interval: every worker idle
                    steps = [
                        ("pickup", lambda: pickup(env, client, args.runs)),
                        ("e2e", lambda: end_to_end(client, min(args.runs, 200))),
                        ("signal", lambda: signals(env, client, min(args.runs, 100))),
                        ("child", lambda: children(env, client, min(args.runs, 100))),
                        ("sleep", lambda: sleeps(env, client, min(args.runs, 100))),
                        ("retry", lambda: retries(env, client, min(args.runs, 50))),
                    ]
                    for name, fn in steps:
                        if name in only:
                            fn()
                    if "load" in only:
                        rate = drain_rate(env, client, 5000)
                        print(f"  drain of 5,000 one-step runs: {rate:,.0f} steps/s", flush=True)
                        for share in (0.5, 0.9):
                            time.sleep(1.5)
                            load(env, client, args.seconds, rate, share)
            finally:
                sup.stop()
    if "cost" in only:
        cost(base, args.steps, args.workers, args.reps)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    threading.current_thread().name = "latency"
    raise SystemExit(main())

"""Churn: steady submission at a set rate for N minutes with retention on. Prints figures.

    python bench/churn.py [--rate auto|RUNS_PER_S] [--share 0.8] [--minutes 30] [--retention 60]
                          [--history-after 10] [--workers 4] [--window 30] [--dsn DSN]
                          [--stall SECONDS --stall-at SECONDS]

A fresh schema, a real `cyclone-supervisor` (`--workers` workers and its scanner, `[scanner]
retention` and `history_after` as given; `--history-after 0` is the old way: runs stay hot
until retention deletes them), and one-step no-op runs submitted through `Client.submit_many`
at `--rate` runs/s, in batches every 100 ms, for `--minutes`. `--rate auto` (the default)
first measures the drain rate of this very setup (same config, retention on, a fresh schema):
runs submitted through `submit_many` as fast as they drain, keeping a backlog of a few seconds,
for 90 s, the completions of the last 60 s counted; the churn then submits at `--share` (80%)
of it. Every `--window` seconds a line:
completions/s in the window, rows and bytes (table + indexes + TOAST) of the hot tables and of
history, dead tuples of the hot tables, autovacuum runs so far on them, how long the oldest
due step has waited, and the share of the machine's CPU its host stole (a VM's `steal`). At
the end: the first and last windows' completion rates and their ratio, rows kept against rate
x (retention + sweep period), bytes kept in the last windows against those after the first
retention period, and the windows that lost more than a tenth of the CPU to the host.

`--stall S --stall-at T` freezes the supervisor and its children (SIGSTOP, then SIGCONT)
for S seconds from T seconds into the churn, while submission goes on: what a host that takes
the CPU for a minute does. The backlog it leaves drains at the share the churn leaves spare,
and the bytes it made the queue indexes take should be given back (the `reindex` sweep) by
the end.

Targets (issue 25): rows kept within 2x of rate x (retention + sweep period), bytes flat after
the first retention period, completions/s within 10% from the first window to the last.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from launch import Supervisor
from runtime import bench_1step

from cyclone import Client
from cyclone.testing import TestEnv, server_dsn

CONFIG = """
[database]
migrate = false
[supervisor]
workers = {workers}
kill_grace = "200ms"
max_steps_per_worker = 0
[worker]
lease_ttl = "30s"
heartbeat_interval = "5s"
poll_interval = "100ms"
[scanner]
interval = "1s"
retention = "{retention}s"
history_after = "{history_after}s"
[metrics]
port = 0
[workflows]
modules = ["runtime"]
[logging]
level = "warning"
"""

HOT = ("cyclone_runs", "cyclone_steps", "cyclone_step_attempts")
HISTORY = ("cyclone_history_runs", "cyclone_history_steps", "cyclone_history_attempts")
# Rows and bytes of a partitioned table are its partitions'.
SIZES = """
SELECT coalesce(sum(c.reltuples) FILTER (WHERE c.reltuples > 0), 0)::bigint AS est,
       coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint AS bytes
  FROM pg_class c
 WHERE c.oid = to_regclass(%(t)s)
    OR c.oid IN (SELECT relid FROM pg_partition_tree(to_regclass(%(t)s)) WHERE isleaf)
"""
STATS = """
SELECT coalesce(n_dead_tup, 0) AS dead, coalesce(autovacuum_count, 0) AS autovacuums,
       coalesce(autoanalyze_count, 0) AS autoanalyzes
  FROM pg_stat_user_tables WHERE relid = to_regclass(%(t)s)
"""
# Runs not yet ended (what was submitted and is not among them ended: retention drops ended
# runs, so they cannot be counted where they are kept).
LIVE = "SELECT count(*) AS n FROM cyclone_runs WHERE state IN ('running', 'queued', 'paused')"
RELATIONS = """
SELECT c.relname AS name, pg_relation_size(c.oid) AS bytes, c.relfilenode AS file
  FROM pg_class c
 WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'i')
   AND (c.relname IN ('cyclone_runs', 'cyclone_steps')
        OR c.oid IN (SELECT indexrelid FROM pg_index
                      WHERE indrelid IN ('cyclone_runs'::regclass, 'cyclone_steps'::regclass)))
 ORDER BY bytes DESC
"""
OLDEST_DUE = "SELECT extract(epoch FROM now() - cyclone_oldest_due(now()))::float8 AS wait"


def row(env: TestEnv, sql: str, **params: Any) -> dict[str, Any]:
    return env.conn.execute(sql, params).fetchone()  # type: ignore[arg-type,return-value]


def count(env: TestEnv, table: str) -> int:
    return int(row(env, f"SELECT count(*) AS n FROM {table}")["n"])


class Submitter(threading.Thread):
    """`rate` runs/s through the public API, in a batch every 100 ms, until stopped."""

    def __init__(self, dsn: str, rate: float) -> None:
        super().__init__(daemon=True)
        self.dsn, self.rate, self.sent = dsn, rate, 0
        self.stopping = threading.Event()
        self.behind = 0.0  # the most it fell behind its schedule, seconds

    def run(self) -> None:
        wf = bench_1step
        start = time.monotonic()
        with Client(self.dsn) as client:
            while not self.stopping.is_set():
                due = int((time.monotonic() - start) * self.rate) - self.sent
                if due > 0:
                    client.submit_many(wf, [None] * due)
                    self.sent += due
                    self.behind = max(self.behind, due / self.rate - 0.1)
                self.stopping.wait(0.1)


class Saturator(threading.Thread):
    """Keeps about `backlog` runs not yet ended, through the public API, until stopped."""

    def __init__(self, dsn: str, backlog: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.backlog, self.sent = dsn, backlog, 0
        self.stopping = threading.Event()

    def run(self) -> None:
        with Client(self.dsn) as client, psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stopping.is_set():
                live = int(conn.execute(LIVE).fetchone()[0])  # type: ignore[index]
                if live < self.backlog:
                    n = min(self.backlog - live, 2000)
                    client.submit_many(bench_1step, [None] * n)
                    self.sent += n
                self.stopping.wait(0.05)


def drain_rate(dsn: str, config: str, seconds: float = 90.0, counted: float = 60.0) -> float:
    """Completions/s of this setup kept busy through the public API (a fresh schema)."""
    with TestEnv(dsn=dsn) as env, tempfile.TemporaryDirectory() as tmp:
        env.register(bench_1step)
        sup = Supervisor(env.dsn, Path(tmp), config)
        sat = Saturator(env.dsn, backlog=6000)
        try:
            sat.start()
            time.sleep(seconds - counted)
            t0, done0 = time.monotonic(), sat.sent - int(row(env, LIVE)["n"])
            env.conn.commit()
            time.sleep(counted)
            t1, done1 = time.monotonic(), sat.sent - int(row(env, LIVE)["n"])
            env.conn.commit()
        finally:
            sat.stopping.set()
            sat.join(10)
            sup.stop()
    return (done1 - done0) / (t1 - t0)


def measure(env: TestEnv, submitter: Submitter) -> dict[str, Any]:
    sent = submitter.sent
    out: dict[str, Any] = {"completed": sent - int(row(env, LIVE)["n"])}
    for t in HOT:
        out[t] = count(env, t)
        out[t + ":bytes"] = int(row(env, SIZES, t=t)["bytes"])
        stats = row(env, STATS, t=t)
        out[t + ":dead"] = int(stats["dead"])
        out[t + ":av"] = int(stats["autovacuums"])
    for t in HISTORY:
        out[t] = count(env, t)
        out[t + ":bytes"] = int(row(env, SIZES, t=t)["bytes"])
    out["partitions"] = count(env, "cyclone_history_partitions")
    out["oldest_due"] = row(env, OLDEST_DUE)["wait"] or 0.0
    env.conn.commit()
    return out


def relation_bytes(env: TestEnv) -> dict[str, int]:
    return {rel["name"]: rel["bytes"] for rel in env.conn.execute(RELATIONS).fetchall()}


def rebuilt(env: TestEnv, files: dict[str, tuple[int, int]]) -> list[str]:
    """The hot relations given a new file since the last call, each with its MiB before and
    after: the reindex sweep's rebuilds (VACUUM's truncation keeps the file). `files` is kept
    between calls."""
    out = []
    for rel in env.conn.execute(RELATIONS).fetchall():
        was = files.get(rel["name"])
        if was is not None and was[0] != rel["file"]:
            out.append(f"{rel['name']} {was[1] / 2**20:.2f}->{rel['bytes'] / 2**20:.2f}")
        files[rel["name"]] = (rel["file"], rel["bytes"])
    env.conn.commit()
    return out


def cpu_ticks() -> tuple[int, int] | None:
    """The machine's CPU time stolen by its host and in all (jiffies, /proc/stat; None off
    Linux). On a VM a neighbour can take a third of the CPU for minutes: a churn at 80% of
    the drain then falls behind, and the backlog it builds stays in the indexes' bytes."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal: guest time is already in user and nice.
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_pct(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    if before is None or after is None or after[1] <= before[1]:
        return float("nan")
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


def freeze(sup: Supervisor, at: float, seconds: float) -> None:
    """From `at` seconds on, `seconds` with the supervisor and its children stopped."""

    def stall() -> None:
        time.sleep(at)
        pids = [sup.popen.pid, *sup.children()]
        print(f"-- stall: {len(pids)} processes stopped for {seconds:.0f}s", flush=True)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        print("-- stall over", flush=True)

    threading.Thread(target=stall, daemon=True).start()


def mib(n: int) -> str:
    return f"{n / 2**20:7.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="auto", help="runs/s, or auto: --share of the drain")
    parser.add_argument("--share", type=float, default=0.8)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--retention", type=float, default=60.0)
    parser.add_argument("--history-after", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--stall", type=float, default=0.0, help="seconds frozen (SIGSTOP)")
    parser.add_argument("--stall-at", type=float, default=300.0, help="seconds into the churn")
    args = parser.parse_args()
    # A SIGTERM ends the run as ^C does: the supervisor stopped, the schema dropped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sweep_period = 1.0  # [scanner] interval: the history sweep runs every pass
    dsn = args.dsn or server_dsn()
    config = CONFIG.format(workers=args.workers, retention=args.retention,
                           history_after=args.history_after)  # fmt: skip
    if args.rate == "auto":
        drained = drain_rate(dsn, config)
        args.rate = round(drained * args.share)
        print(f"drain rate of this setup, kept busy through submit_many: {drained:.0f} runs/s;"
              f" churn at {args.share:.0%} of it: {args.rate} runs/s", flush=True)  # fmt: skip
    else:
        args.rate = float(args.rate)
    with TestEnv(dsn=dsn) as env, tempfile.TemporaryDirectory() as tmp:
        env.register(bench_1step)
        sup = Supervisor(env.dsn, Path(tmp), config)
        submitter = Submitter(env.dsn, args.rate)
        print(
            f"churn: {args.rate:.0f} runs/s for {args.minutes} min, retention "
            f"{args.retention:.0f}s, history_after {args.history_after:.0f}s, "
            f"{args.workers} workers"
        )
        print(
            " t(s)  done/s  runs_hot  steps_hot  hist_runs  parts  hot_MiB hist_MiB"
            "  dead_runs dead_steps  av_runs av_steps  oldest_due(s)  steal%"
        )
        windows: list[dict[str, Any]] = []
        settle_t = args.retention + args.history_after + 60
        early_rels: dict[str, int] = {}  # each hot relation's bytes after the first retention
        files: dict[str, tuple[int, int]] = {}
        rebuilt(env, files)
        try:
            submitter.start()
            start = time.monotonic()
            if args.stall > 0:
                freeze(sup, args.stall_at, args.stall)
            last = measure(env, submitter)
            last_t, last_ticks = start, cpu_ticks()
            while time.monotonic() - start < args.minutes * 60:
                time.sleep(max(0.0, last_t + args.window - time.monotonic()))
                if sup.popen.poll() is not None:
                    print(sup.log_path.read_text()[-3000:], file=sys.stderr)
                    return 1
                now, ticks = time.monotonic(), cpu_ticks()
                cur = measure(env, submitter)
                rate = (cur["completed"] - last["completed"]) / (now - last_t)
                hot = sum(cur[t + ":bytes"] for t in HOT)
                hist = sum(cur[t + ":bytes"] for t in HISTORY)
                cur.update(t=now - start, rate=rate, hot_bytes=hot, hist_bytes=hist,
                           steal=steal_pct(last_ticks, ticks),
                           kept=cur["cyclone_runs"] + cur["cyclone_history_runs"])  # fmt: skip
                windows.append(cur)
                print(
                    f"{cur['t']:5.0f} {rate:7.0f} {cur['cyclone_runs']:9d} "
                    f"{cur['cyclone_steps']:10d} {cur['cyclone_history_runs']:10d} "
                    f"{cur['partitions']:6d} {mib(hot)} {mib(hist)} "
                    f"{cur['cyclone_runs:dead']:10d} {cur['cyclone_steps:dead']:10d} "
                    f"{cur['cyclone_runs:av']:8d} {cur['cyclone_steps:av']:8d} "
                    f"{cur['oldest_due']:14.2f} {cur['steal']:7.0f}",
                    flush=True,
                )
                for what in rebuilt(env, files):
                    print(f"      rebuilt: {what} MiB", flush=True)
                if not early_rels and cur["t"] > settle_t:
                    early_rels = {name: size for name, (_, size) in files.items()}
                last, last_t, last_ticks = cur, now, ticks
        finally:
            submitter.stopping.set()
            submitter.join(10)
            sup.stop()
        first, final = windows[0], windows[-1]
        settled = [w for w in windows if w["t"] > settle_t]
        bound = args.rate * (args.retention + sweep_period)
        print(f"submitted {submitter.sent} runs; the submitter fell behind by at most "
              f"{submitter.behind:.2f}s")  # fmt: skip
        print(f"completions/s: first window {first['rate']:.0f}, last {final['rate']:.0f}, "
              f"ratio {final['rate'] / first['rate']:.2f} (target >= 0.90)")  # fmt: skip
        most = max(w["kept"] for w in windows)
        print(
            f"runs kept (hot + history): most {most}, last {final['kept']}; rate x (retention"
            f" + sweep period) = {bound:.0f}; most / that = {most / bound:.2f} (target <= 2)"
        )
        if len(settled) >= 2:
            early, late = settled[0], settled[-1]
            for what in ("hot_bytes", "hist_bytes"):
                print(f"{what}: {mib(early[what])} MiB after the first retention period, "
                      f"{mib(late[what])} MiB at the end, ratio "
                      f"{late[what] / max(early[what], 1):.2f}")  # fmt: skip
        print(f"oldest due step's wait, most: {max(w['oldest_due'] for w in windows):.2f}s")
        stolen = [f"{w['t']:.0f}s ({w['steal']:.0f}%)" for w in windows if w["steal"] > 10]
        print(textwrap.fill("windows with more than 10% of the CPU stolen by the host: "
                            + (", ".join(stolen) if stolen else "none"),
                            width=79, subsequent_indent="  "))  # fmt: skip
        # Which relation grows, if the hot bytes do: each after the first retention period
        # and at the end.
        print("the hot tables' relations (MiB): after the first retention period, at the end")
        for name, size in relation_bytes(env).items():
            was = early_rels.get(name)
            then = "       -" if was is None else f"{was / 2**20:8.2f}"
            ratio = "" if not was else f"  x{size / was:.2f}"
            print(f"  {name:40s} {then} {size / 2**20:8.2f}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

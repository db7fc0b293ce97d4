"""The real supervisor end to end: throughput, kill latency and memory. Prints figures.

    python bench/runtime.py [--steps 20000] [--workers 4,8] [--reps 3] [--kills 50]
                            [--memory 1000,10000] [--respawns 1000,10000]
                            [--only throughput,kills,memory,respawns,cpu,flow,fair]
                            [--flows declared,keyed,node,rate,key,wide] [--strip]
                            [--dispatch true|false|true,false] [--baseline two|one]
                            [--limits-elsewhere] [--dsn DSN]

* throughput: `cyclone-supervisor` with N workers drains pre-filled no-op 1-step and 5-step
  runs; timed from its READY=1 (systemd notify socket) to the `finished_at` of the last run,
  read on the database clock once every run is done (polled every 200 ms). The minimal
  baseline loop of bench/engine.py runs on the same server in the same run, with the same N
  forked processes, and the ratio is supervisor / baseline. `--dispatch true,false` runs
  each config with the supervisor leasing for its workers and with each worker leasing on
  its own ([supervisor] dispatch). `--reps` repeats every config,
  interleaved, and reports medians. `--baseline one`: the baseline completes a step and
  leases the next in one statement, one commit a step (bench/engine.py, BL1_STEP), instead of
  two. The supervisor serves bench/shapes.py, which declares no limit; with
  `--limits-elsewhere` it serves this module, whose other workflows declare node, key and
  rate limits (none of them drained here): it then sends steps_dispatch, which looks for
  limited steps, rather than steps_dispatch_plain.
* kills: a handler that ignores ctx.done and SIGTERM, killed at its run's deadline, on cancel
  and at its step timeout; latency from deadline_at / just before the cancel call / lease time
  + timeout (all on the database clock, which is this host's) to the worker process seen dead
  in /proc (gone or a zombie), polled every millisecond.
* flow (only when asked for): 1-step drains with flow control beside the same drain with no
  limits, in one run: limits declared but never binding, and Concurrency(limit=1) over 100
  keys (docs/flow-control.md); the ratio is to the no-limit drain of the same rep. `--flows`
  picks the drains: by default those two; node, rate and key are each declared limit alone;
  wide is declared with a node limit of 256 rather than 64.
* fair (only when asked for): a backlog of --steps runs of one key drains; a second in, one
  run of another key is submitted: how long it waited and how many steps went first.
* cpu (only when asked for): where a step's CPU goes, in microseconds a step, for one drain of
  each config: the PostgreSQL server (the postmaster and every backend, reaped ones included)
  and each kind of process of ours (baseline clients; cyclone workers, supervisor, scanner),
  read from /proc/PID/stat. When every process is CPU-bound, as with 4 or 8 workers on a
  2-core VM, the ratio of the two totals is the throughput ratio the machine allows. With
  `--strip`, cyclone's schema first loses its rule triggers and the indexes its hot
  statements do not read (instructions.py's STRIP): an experiment, not a shippable schema.
* memory: supervisor RSS and every worker's PSS (/proc/PID/smaps_rollup) after the first
  `--memory` counts of no-op steps, workers never recycled.

This module is also the supervisor's workflow module (`[workflows] modules = ["runtime"]`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import engine
import launch
from engine import (
    SHAPES,
    Meter,
    _stat,
    baseline_fill,
    connect,
    engine_fill,
    process_cpu,
    revision,
    run_workers,
    settle,
)
from instructions import STRIP

import cyclone
from cyclone.testing import TestEnv, server_dsn

HERE = Path(__file__).resolve().parent
# [supervisor] dispatch of every supervisor this script starts (--dispatch sets it per config).
DISPATCH = "true"
# The minimal loop the supervisor is compared with (--baseline): two commits a step, or one.
BASELINE = "baseline"

bench_1step, bench_5step = SHAPES[1], SHAPES[5]

# Flow-controlled 1-step drains (--only flow), each beside the same drain with no limits:
# limits declared but not binding (a per-key limit no key reaches, a node limit of 64 steps at
# once, above any drain's workers, and a rate limit far above the drain), and a binding
# per-key limit of 1 over FLOW_KEYS keys.
FLOW_KEYS = 100
bench_declared = cyclone.Workflow(
    "bench_declared", concurrency=cyclone.Concurrency(key="k", limit=1_000_000)
)
bench_declared.task(engine._noop, name="s1", concurrency=64, rate_limit="bench-unbound")
# The same with a node limit of 256 (--flows wide). Until migration 33 the steps made available
# for the workers held slots too, and with twelve leases queued a worker a limit of 64 bound
# that pool where 256 did not; now a slot is held by a lease alone, and both drain alike.
bench_wide = cyclone.Workflow(
    "bench_wide", concurrency=cyclone.Concurrency(key="k", limit=1_000_000)
)
bench_wide.task(engine._noop, name="s1", concurrency=256, rate_limit="bench-unbound")
bench_keyed = cyclone.Workflow("bench_keyed", concurrency=cyclone.Concurrency(key="k", limit=1))
bench_keyed.task(engine._noop, name="s1")
# Each of the declared limits alone (--flows node,rate,key): what each costs.
bench_node = cyclone.Workflow("bench_node")
bench_node.task(engine._noop, name="s1", concurrency=64)
bench_rate = cyclone.Workflow("bench_rate")
bench_rate.task(engine._noop, name="s1", rate_limit="bench-unbound")
bench_key = cyclone.Workflow("bench_key", concurrency=cyclone.Concurrency(key="k", limit=1_000_000))
bench_key.task(engine._noop, name="s1")
FLOWS = {
    "none": bench_1step, "declared": bench_declared, "keyed": bench_keyed, "wide": bench_wide,
    "node": bench_node, "rate": bench_rate, "key": bench_key,
}  # fmt: skip
# --only fair: a backlog of one key, and a run of another key submitted while it drains.
bench_fair = cyclone.Workflow("bench_fair", concurrency=cyclone.Concurrency(key="k", limit=10**6))
bench_fair.task(engine._noop, name="s1")


def _hang(ctx: cyclone.StepContext) -> None:
    """Note our pid, then ignore ctx.done: only the supervisor's SIGKILL ends this."""
    (Path(ctx.input["dir"]) / f"{ctx.step_id}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.01)


hang = cyclone.Workflow("bench-hang")
hang.task(name="hang", timeout=timedelta(minutes=10), max_attempts=1)(_hang)
hang_timeout = cyclone.Workflow("bench-hang-timeout")
hang_timeout.task(name="hang", timeout=timedelta(seconds=1), max_attempts=1)(_hang)

CONFIG = """
[database]
migrate = false
[supervisor]
workers = {workers}
kill_grace = "{kill_grace}"
max_steps_per_worker = {max_steps}
dispatch = {dispatch}
wake = {wake}
[worker]
lease_ttl = "30s"
heartbeat_interval = "5s"
poll_interval = "{poll}"
[scanner]
interval = "{scan}"
[metrics]
port = {port}
[workflows]
modules = [{modules}]
[logging]
level = "warning"
"""


class Supervisor(launch.Supervisor):
    """A cyclone-supervisor subprocess on `dsn` with CONFIG, its READY=1 awaited."""

    def __init__(self, dsn: str, tmp: Path, workers: int, **config: str) -> None:
        options = {
            "kill_grace": "200ms", "poll": "100ms", "scan": "500ms", "port": "0",
            "max_steps": "0", "modules": '"runtime"', "dispatch": DISPATCH, "wake": "true",
            **config,
        }  # fmt: skip
        super().__init__(dsn, tmp, CONFIG.format(workers=workers, **options))
        self.ready_wall: float

    def workers(self) -> list[int]:
        return [p for p in self.children() if cmdline(p).startswith("cyclone worker")]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def dead(pid: int) -> bool:
    fields = _stat(pid)
    return fields is None or fields[0] in ("Z", "X")


COMPLETED = "SELECT count(*) FROM cyclone_runs WHERE state = 'completed'"
LAST_FINISH = "SELECT extract(epoch FROM max(finished_at))::float8 FROM cyclone_runs"
# Reads the partial index of active runs and stops at the first live entry.
ANY_ACTIVE = (
    "SELECT EXISTS (SELECT 1 FROM cyclone_runs WHERE state IN ('running', 'paused'))"
    " OR EXISTS (SELECT 1 FROM cyclone_runs WHERE state = 'queued')"
)


def wait_completed(
    env: TestEnv, sup: Supervisor, runs: int, interval: float, drained: bool = False
) -> None:
    """Poll until `runs` runs completed; fail loudly if the supervisor died or progress stops.

    With `drained` (every run submitted is to complete), the frequent poll is the cheap
    ANY_ACTIVE and runs are counted once a second: the throughput figure should not pay for
    its own clock, as the baseline, timed by its processes' exits, does not.
    """
    last, since, counted = -1, time.monotonic(), 0.0
    while True:
        now = time.monotonic()
        if not drained or now - counted >= 1.0 or not scalar(env, ANY_ACTIVE):
            done, counted = scalar(env, COMPLETED), now
            if done >= runs:
                return
            if done != last:
                last, since = done, now
        if sup.popen.poll() is not None or now - since > 60:
            tail = sup.log()[-3000:]
            raise RuntimeError(f"no progress at {last}/{runs} runs; supervisor log:\n{tail}")
        time.sleep(interval)


def clock_offset(env: TestEnv) -> float:
    """The database clock minus this host's wall clock, to within half a round trip."""
    before = time.time()
    server = scalar(env, "SELECT extract(epoch FROM clock_timestamp())::float8")
    return server - (before + time.time()) / 2


def scalar(env: TestEnv, sql: str, *params: Any) -> Any:
    row = env.conn.execute(sql, params).fetchone()  # type: ignore[arg-type]
    return next(iter(row.values()))


# -- throughput ------------------------------------------------------------------------------


# The throughput and cpu drains' supervisor's module: none declares a limit (--limits-elsewhere:
# this one, whose flow drains' workflows do).
SERVED = "shapes"


def throughput(
    base: str, steps: int, shape: int, workers: int, baseline_first: bool = True,
    dispatch: str = "true",
) -> tuple[float, float]:  # fmt: skip
    """(supervisor steps/s, baseline steps/s) on fresh schemas of the same server."""
    runs = steps // shape

    def baseline() -> float:
        with TestEnv(dsn=base) as env:
            baseline_fill(env.conn, shape, runs)
            settle(env.conn, "bl_runs, bl_steps")
            elapsed, _ = run_workers(env.dsn, BASELINE, shape, workers, runs * shape)
        return runs * shape / elapsed

    def supervisor() -> float:
        with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
            engine_fill(env, shape, runs)
            settle(env.conn, "cyclone_runs, cyclone_steps")
            offset = clock_offset(env)
            sup = Supervisor(
                env.dsn, Path(tmp), workers, dispatch=dispatch, modules=f'"{SERVED}"'
            )
            try:
                # Polled slowly, timed exactly: from READY=1 to the last run's finish as the
                # database recorded it, so the poll costs the server next to nothing.
                wait_completed(env, sup, runs, 0.2, drained=True)
                last = scalar(env, LAST_FINISH)
                elapsed = last - (sup.ready_wall + offset)
            finally:
                sup.stop()
        return runs * shape / elapsed

    if baseline_first:
        rate = baseline()
        return supervisor(), rate
    rate = supervisor()
    return rate, baseline()


def throughput_reps(
    base: str, steps: int, configs: list[tuple[int, int, str]], reps: int
) -> dict[tuple[int, int, str], list[tuple[float, float]]]:
    """Every config once per rep, reps interleaved and the order of the two alternating, so
    that a noisy stretch of a shared machine hits both sides alike."""
    results: dict[tuple[int, int, str], list[tuple[float, float]]] = {c: [] for c in configs}
    for rep in range(reps):
        for shape, n, dispatch in configs:
            sup, rate = throughput(base, steps, shape, n, rep % 2 == 0, dispatch)
            results[(shape, n, dispatch)].append((sup, rate))
            print(f"  rep {rep + 1}/{reps}  {shape}-step N={n} dispatch={dispatch}: supervisor"
                  f" {sup:,.0f}/s, baseline {rate:,.0f}/s, ratio {sup / rate:.2f}",
                  flush=True)  # fmt: skip
    return results


def flow_drain(base: str, steps: int, workers: int, flow: str) -> float:
    """Steps/s of a supervisor draining `steps` 1-step runs of FLOWS[flow], submitted through
    the public API (keys 0..FLOW_KEYS-1 in turn), never analyzed."""
    wf = FLOWS[flow]
    with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
        with cyclone.Client(env.dsn) as client:  # closed (pool threads joined) before any fork
            client.set_rate_limit("bench-unbound", rate=1e9, per=1.0, burst=1e9)
            for start in range(0, steps, engine.BATCH):
                n = min(engine.BATCH, steps - start)
                client.submit_many(wf, [{"k": (start + i) % FLOW_KEYS} for i in range(n)])
        offset = clock_offset(env)
        sup = Supervisor(env.dsn, Path(tmp), workers)
        try:
            wait_completed(env, sup, steps, 0.2, drained=True)
            last = scalar(env, LAST_FINISH)
            elapsed = last - (sup.ready_wall + offset)
        finally:
            sup.stop()
    return steps / elapsed


def flow_reps(base: str, steps: int, workers: list[int], reps: int, flows: list[str]) -> None:
    """Each flow beside the no-limit drain, reps interleaved; medians of the per-rep ratios."""
    ratios: dict[tuple[str, int], list[float]] = {}
    rates: dict[tuple[str, int], list[float]] = {}
    for rep in range(reps):
        for n in workers:
            order = ["none", *flows] if rep % 2 == 0 else [*reversed(flows), "none"]
            got = {flow: flow_drain(base, steps, n, flow) for flow in order}
            for flow, rate in got.items():
                rates.setdefault((flow, n), []).append(rate)
                ratios.setdefault((flow, n), []).append(rate / got["none"])
            print(f"  rep {rep + 1}/{reps} N={n}: "
                  + ", ".join(f"{f} {r:,.0f}/s" for f, r in got.items()), flush=True)
    print(f"\nMedians over {reps} reps; ratio to the same drain with no limits (min-max)")
    for (flow, n), values in ratios.items():
        print(f"{flow:>9} N={n}: {statistics.median(rates[(flow, n)]):>7,.0f}/s"
              f"  ratio {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})",
              flush=True)  # fmt: skip


def fairness(base: str, backlog: int, workers: int) -> dict[str, float]:
    """A backlog of `backlog` one-step runs of key "big", drained by a supervisor; a second
    into the drain, one run of key "small". How long it waited (database clock, submit to
    lease) and how many steps were leased meanwhile, beside how many of the backlog were
    still waiting when it came (what FIFO would have run first)."""
    with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
        with cyclone.Client(env.dsn) as client:
            for start in range(0, backlog, engine.BATCH):
                client.submit_many(bench_fair, [{"k": "big"}] * min(engine.BATCH, backlog - start))
        sup = Supervisor(env.dsn, Path(tmp), workers)
        try:
            # The drain is under way: a hundred runs done.
            while scalar(env, COMPLETED) < 100:
                if sup.popen.poll() is not None:
                    raise RuntimeError(f"the supervisor died:\n{sup.log()[-3000:]}")
                time.sleep(0.05)
            with cyclone.Client(env.dsn) as client:
                waiting = scalar(env, "SELECT count(*) FROM cyclone_steps"
                                      " WHERE state = 'available'")  # fmt: skip
                small = client.submit(bench_fair, {"k": "small"})
                client.wait(small, timeout=120)
            row = env.conn.execute(
                "SELECT extract(epoch FROM s.started_at - r.created_at)::float8 AS waited,"
                " (SELECT count(*) FROM cyclone_steps o WHERE o.started_at > r.created_at"
                "   AND o.started_at < s.started_at) AS before"
                " FROM cyclone_runs r JOIN cyclone_steps s ON s.run_id = r.id WHERE r.id = %s",
                (small,),
            ).fetchone()
        finally:
            sup.stop()
    return {"waited": row["waited"], "before": row["before"], "backlog_left": waiting}


# -- where the CPU goes -----------------------------------------------------------------------


def server_seconds(meter: Meter) -> float:
    seconds = meter.server_cpu()
    if seconds is None:
        raise SystemExit("--only cpu needs the server on this host")
    return seconds


def cpu_split(
    base: str, steps: int, shape: int, workers: int, strip: bool = False,
    dispatch: str = "true",
) -> dict[str, dict[str, float]]:  # fmt: skip
    """CPU seconds by process kind for one drain each: {"baseline": {...}, "cyclone": {...}}."""
    runs = steps // shape
    with TestEnv(dsn=base) as env:
        baseline_fill(env.conn, shape, runs)
        settle(env.conn, "bl_runs, bl_steps")
        meter = Meter(env.dsn)
        server = server_seconds(meter)
        _, clients = run_workers(env.dsn, BASELINE, shape, workers, runs * shape)
        baseline = {"postgres": server_seconds(meter) - server, "clients": clients}
        meter.close()
    with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
        engine_fill(env, shape, runs)
        if strip:
            env.conn.execute(STRIP)
        settle(env.conn, "cyclone_runs, cyclone_steps")
        meter = Meter(env.dsn)
        sup = Supervisor(env.dsn, Path(tmp), workers, dispatch=dispatch, modules=f'"{SERVED}"')
        try:
            before = {pid: process_cpu(pid) for pid in [sup.popen.pid, *sup.children()]}
            server = server_seconds(meter)
            wait_completed(env, sup, runs, 0.2, drained=True)
            cyclone_cpu = {"postgres": server_seconds(meter) - server}
            ours = {pid: process_cpu(pid) - cpu for pid, cpu in before.items()}
            # Told apart by title only now: a child may not have set its own by READY=1.
            kinds = {pid: "scanner" if cmdline(pid).startswith("cyclone scanner") else "workers"
                     for pid in before}  # fmt: skip
            kinds[sup.popen.pid] = "supervisor"
        finally:
            sup.stop()
            meter.close()
    for pid, kind in kinds.items():
        cyclone_cpu[kind] = cyclone_cpu.get(kind, 0.0) + ours[pid]
    return {"baseline": baseline, "cyclone": cyclone_cpu}


# -- kill latency ----------------------------------------------------------------------------


def wait_pids(tmp: Path, step_ids: list[int]) -> dict[int, int]:
    """step id -> the pid of the worker running it, once every handler wrote its note."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        notes = [tmp / f"{s}.pid" for s in step_ids]
        if all(n.exists() and n.read_text() for n in notes):
            return {s: int(n.read_text()) for s, n in zip(step_ids, notes, strict=True)}
        time.sleep(0.002)
    raise RuntimeError("handlers did not start within 60s")


def deaths(pids: dict[int, int]) -> dict[int, float]:
    """step id -> wall time its worker was first seen dead."""
    seen: dict[int, float] = {}
    deadline = time.monotonic() + 60
    while len(seen) < len(pids) and time.monotonic() < deadline:
        for step, pid in pids.items():
            if step not in seen and dead(pid):
                seen[step] = time.time()
        time.sleep(0.001)
    if len(seen) < len(pids):
        raise RuntimeError("a handler outlived its kill by 60s")
    return seen


def step_of(env: TestEnv, run_id: str) -> int:
    return scalar(env, "SELECT id FROM cyclone_steps WHERE run_id = %s", run_id)


def kill_batch(env: TestEnv, sup: Supervisor, tmp: Path, kind: str, n: int) -> list[float]:
    while len(sup.workers()) < n:  # replacements of the last batch
        time.sleep(0.005)
    if kind == "deadline":
        runs = [env.client.submit(hang, {"dir": str(tmp)}, run_deadline=1.0) for _ in range(n)]
    else:
        flow = hang_timeout if kind == "timeout" else hang
        runs = [env.client.submit(flow, {"dir": str(tmp)}) for _ in range(n)]
    steps = {step_of(env, r): r for r in runs}
    pids = wait_pids(tmp, list(steps))
    origin: dict[int, float] = {}
    if kind == "cancel":
        for step, run_id in steps.items():
            origin[step] = time.time()
            env.client.cancel(run_id)
    died = deaths(pids)
    for step, run_id in steps.items():
        if kind == "deadline":
            at = scalar(env, "SELECT deadline_at FROM cyclone_runs WHERE id = %s", run_id)
            origin[step] = at.timestamp()
        elif kind == "timeout":
            at = scalar(env, "SELECT started_at FROM cyclone_v_steps WHERE id = %s", step)
            origin[step] = at.timestamp() + 1.0
    return [died[s] - origin[s] for s in steps]


def kill_latency(base: str, kills: int, workers: int = 4) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
        sup = Supervisor(env.dsn, Path(tmp), workers)
        try:
            for kind in ("deadline", "cancel", "timeout"):
                found[kind] = []
                while len(found[kind]) < kills:
                    found[kind] += kill_batch(env, sup, Path(tmp), kind, workers)
        finally:
            sup.stop()
    return found


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- memory ----------------------------------------------------------------------------------


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def memory(base: str, marks: list[int], workers: int = 4) -> list[tuple[int, int, list[int]]]:
    """(steps done, supervisor RSS kB, worker PSS kB each) at each mark."""
    found = []
    with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
        sup = Supervisor(env.dsn, Path(tmp), workers)
        try:
            done = 0
            for mark in marks:
                engine_fill(env, 1, mark - done)
                done = mark
                wait_completed(env, sup, done, 0.05)
                time.sleep(0.5)  # the workers' last Done lines reach the supervisor
                pids = sup.workers()
                found.append((done, rss_kb(sup.popen.pid), [pss_kb(p) for p in pids]))
        finally:
            sup.stop()
    return found


def respawns(base: str, marks: list[int], workers: int = 4) -> list[tuple[int, int, int, int]]:
    """Workers recycled after every step: (steps done, supervisor RSS kB, open fds, files left
    in the supervisor's TMPDIR) at each mark, so growth per respawn shows."""
    found = []
    with TestEnv(dsn=base) as env, tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "tmp"
        scratch.mkdir()
        os.environ["TMPDIR"] = str(scratch)
        try:
            sup = Supervisor(env.dsn, Path(tmp), workers, max_steps="1")
        finally:
            del os.environ["TMPDIR"]
        try:
            done = 0
            for mark in marks:
                engine_fill(env, 1, mark - done)
                done = mark
                wait_completed(env, sup, done, 0.05)
                time.sleep(0.5)  # let the last exits be reaped
                pid = sup.popen.pid
                fds = len(os.listdir(f"/proc/{pid}/fd"))
                found.append((done, rss_kb(pid), fds, len(list(scratch.iterdir()))))
        finally:
            sup.stop()
    return found


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--workers", default="4,8")
    p.add_argument("--reps", type=int, default=3, help="throughput repetitions (default 3)")
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--memory", default="1000,10000")
    p.add_argument("--respawns", default="1000,10000")
    p.add_argument("--only", default="throughput,kills,memory,respawns")
    p.add_argument(
        "--strip", action="store_true", help="cpu: without rule triggers or extra indexes"
    )
    p.add_argument(
        "--analyze",
        action="store_true",
        help="VACUUM ANALYZE after each fill (the fair-weather figure; default: as users drain)",
    )
    p.add_argument(
        "--dispatch", default="true",
        help="throughput, cpu: [supervisor] dispatch, one value or both (true,false)",
    )  # fmt: skip
    p.add_argument(
        "--baseline", choices=("two", "one"), default="two",
        help="throughput, cpu: the minimal loop with two commits a step (default) or one",
    )  # fmt: skip
    p.add_argument(
        "--flows", default="declared,keyed",
        help="flow: the drains beside the one with no limits"
             " (declared, keyed, node, rate, key, wide)",
    )  # fmt: skip
    p.add_argument(
        "--limits-elsewhere", action="store_true",
        help="throughput, cpu: the supervisor serves workflows with limits too (not drained)",
    )  # fmt: skip
    p.add_argument("--dsn", help="server to use (default: the embedded test server)")
    args = p.parse_args(argv)
    flows = args.flows.split(",")
    if not set(flows) <= set(FLOWS) - {"none"}:
        p.error(f"--flows: a list of {', '.join(f for f in FLOWS if f != 'none')},"
                f" not {args.flows!r}")  # fmt: skip
    global BASELINE, SERVED
    BASELINE = "baseline1" if args.baseline == "one" else "baseline"
    SERVED = "runtime" if args.limits_elsewhere else "shapes"
    modes = args.dispatch.split(",")
    if not set(modes) <= {"true", "false"}:
        p.error(f"--dispatch: true, false or true,false, not {args.dispatch!r}")
    engine.ANALYZE_AFTER_FILL = args.analyze
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    base = args.dsn or server_dsn()
    only = set(args.only.split(","))
    with connect("baseline", base) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
    drained = "VACUUM ANALYZE after each fill" if args.analyze else "never analyzed, as users drain"
    print(f"cyclone {revision()}; PostgreSQL {version}; {os.cpu_count()} CPUs; {drained}; "
          f"baseline: {args.baseline} commit(s) a step")  # fmt: skip
    started = time.perf_counter()
    if "throughput" in only:
        declared = "limits declared elsewhere" if args.limits_elsewhere else "no limit declared"
        print(f"\nThroughput, {args.steps} no-op steps per config (supervisor: READY=1 to last"
              f" run; {declared})")  # fmt: skip
        configs = [
            (shape, int(n), mode)
            for shape in (1, 5) for n in args.workers.split(",") for mode in modes
        ]  # fmt: skip
        results = throughput_reps(base, args.steps, configs, args.reps)
        print(f"\nMedians over {args.reps} reps; ratio: median of the per-rep ratios (min-max)")
        print(f"{'workflow':>9} {'workers':>7} {'dispatch':>8} {'supervisor':>12} {'baseline':>10}"
              f" {'ratio':>17}")  # fmt: skip
        for (shape, n, mode), pairs in results.items():
            ratios = [s / b for s, b in pairs]
            print(f"{shape:>4}-step {n:>7} {mode:>8}"
                  f" {statistics.median(s for s, _ in pairs):>8,.0f}/s"
                  f" {statistics.median(b for _, b in pairs):>8,.0f}/s"
                  f" {statistics.median(ratios):>6.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
                  flush=True)  # fmt: skip
    if "flow" in only:
        print(f"\nFlow control, {args.steps} no-op 1-step runs per drain, submitted through"
              f" the API ({FLOW_KEYS} keys): declared = limits that never bind, keyed ="
              " Concurrency(limit=1) per key; node, rate, key = each declared limit"
              " alone; wide = declared with a node limit of 256")  # fmt: skip
        flow_reps(base, args.steps, [int(n) for n in args.workers.split(",")], args.reps, flows)
    if "fair" in only:
        print(f"\nFairness: {args.steps} runs of one key draining, then one run of another "
              "key (database clock, submit to lease)")  # fmt: skip
        for n in (int(w) for w in args.workers.split(",")):
            for rep in range(args.reps):
                got = fairness(base, args.steps, n)
                print(f"  N={n} rep {rep + 1}: waited {got['waited'] * 1000:.0f} ms, "
                      f"{got['before']} steps leased before it, with {got['backlog_left']} of "
                      "the backlog still waiting when it came", flush=True)  # fmt: skip
    if "cpu" in only:
        stripped = " (cyclone stripped)" if args.strip else ""
        print(
            f"\nCPU a step in µs{stripped}, {args.steps} no-op steps, one drain per config (/proc)"
        )
        for shape in (1, 5):
            for n, mode in ((int(w), m) for w in args.workers.split(",") for m in modes):
                split = cpu_split(base, args.steps, shape, n, strip=args.strip, dispatch=mode)
                totals = {side: sum(parts.values()) for side, parts in split.items()}
                label = f"{shape}-step N={n} dispatch={mode}"
                for side, parts in split.items():
                    shown = ", ".join(f"{k} {v / args.steps * 1e6:,.0f}" for k, v in parts.items())
                    print(f"  {label} {side:>8}: {shown};"
                          f" total {totals[side] / args.steps * 1e6:,.0f}", flush=True)  # fmt: skip
                print(f"  {label} baseline/cyclone total:"
                      f" {totals['baseline'] / totals['cyclone']:.2f}", flush=True)  # fmt: skip
    if "kills" in only:
        print(
            f"\nKill latency, {args.kills}+ kills each, 4 workers, kill_grace 200ms,"
            " scanner interval 500ms (to the worker process seen dead in /proc)"
        )
        for kind, values in kill_latency(base, args.kills).items():
            print(f"{kind:>9}: n={len(values)}  p50 {pct(values, 0.5) * 1000:6.0f} ms"
                  f"  p99 {pct(values, 0.99) * 1000:6.0f} ms  max {max(values) * 1000:6.0f} ms"
                  f"  mean {statistics.mean(values) * 1000:6.0f} ms", flush=True)  # fmt: skip
    if "memory" in only:
        marks = [int(m) for m in args.memory.split(",")]
        print("\nMemory, 4 workers, never recycled (supervisor RSS; worker PSS each)")
        for done, rss, pss in memory(base, marks):
            print(
                f"after {done:>6} steps: supervisor RSS {rss / 1024:6.1f} MiB;"
                f" worker PSS {', '.join(f'{k / 1024:.1f}' for k in pss)} MiB",
                flush=True,
            )
    if "respawns" in only:
        marks = [int(m) for m in args.respawns.split(",")]
        print("\nRespawns: 4 workers recycled after every step (one fork per step)")
        for done, rss, fds, files in respawns(base, marks):
            print(
                f"after {done:>6} respawns: supervisor RSS {rss / 1024:6.1f} MiB;"
                f" open fds {fds}; files left in TMPDIR {files}",
                flush=True,
            )
    print(f"\nTotal time {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

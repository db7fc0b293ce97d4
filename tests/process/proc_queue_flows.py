"""Workflows of the queued-lease process tests (test_process_queued.py): each start of a step
appends a line to `starts.log` in the run's directory, so a test can count who ran what."""

from __future__ import annotations

import os
import time
from pathlib import Path

import cyclone

# The step's timeout in `timed`: long enough that a lease may wait queued for READY_FOR (5%
# of it is 250 ms), short enough for a test's patience.
TIMEOUT = 5.0


def note(ctx: cyclone.StepContext, n: int | None = None) -> Path:
    """Append `n step_id attempt pid monotonic` for this start; the directory's path."""
    where = Path(ctx.input["dir"])
    with (where / "starts.log").open("a") as f:
        f.write(f"{ctx.input['n'] if n is None else n} {ctx.step_id} {ctx.attempt} {os.getpid()} "
                f"{time.monotonic():.6f}\n")  # fmt: skip
    return where


def starts(where: Path) -> list[tuple[int, int, int, int, float]]:
    """The lines `note` wrote: (n, step id, attempt, pid, monotonic time)."""
    path = where / "starts.log"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(n), int(s), int(a), int(p), float(t)) for n, s, a, p, t in rows]


queued = cyclone.Workflow("proc-queued")


@queued.task(max_attempts=3)
def step(ctx: cyclone.StepContext) -> int:
    """Sleep `sleep` seconds on the first attempt only."""
    note(ctx)
    if ctx.attempt == 1:
        time.sleep(ctx.input.get("sleep", 0))
    return ctx.input["n"]


# Two steps leased at once (neither waits for the other): a short one, then, queued behind
# it in its worker's name, one with a timeout.
timed = cyclone.Workflow("proc-queued-timed")


@timed.task(max_attempts=1)
def short(ctx: cyclone.StepContext) -> int:
    note(ctx, 0)
    time.sleep(0.15)
    return 0


@timed.task(timeout=TIMEOUT, max_attempts=1)
def until_after(ctx: cyclone.StepContext) -> int:
    """Run until 50 ms past TIMEOUT after `short` started (which ran before this one, and
    whose lease was taken no later than this one's)."""
    where = note(ctx, 1)
    before = next(t for n, _, _, _, t in starts(where) if n == 0)
    time.sleep(max(0.0, before + TIMEOUT + 0.05 - time.monotonic()))
    return 1

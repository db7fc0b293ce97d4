"""Workflows whose handlers hold the GIL in one long C call (issue 29), for test_process_gil.py.

`ctypes.PyDLL` calls a C function without releasing the GIL, so `libc.sleep` through it is
one C call that holds the GIL for as long as asked, CPU or not: no thread of the worker runs
meanwhile, which the handler checks with a thread of its own that counts while it can.
`sum(range(n))` is the CPU-bound kind the issue found (it never releases the GIL either).
"""

from __future__ import annotations

import ctypes
import threading
import time
from datetime import timedelta

import cyclone

_LIBC = ctypes.PyDLL(None)  # PyDLL: the GIL stays held for the whole call


def _held(call) -> dict[str, float]:
    """Run `call` and say how long it took and how often a thread of ours ran meanwhile."""
    ticks = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.wait(0.01):
            ticks[0] += 1

    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    time.sleep(0.05)  # let it start counting
    before, started = ticks[0], time.monotonic()
    call()
    took, during = time.monotonic() - started, ticks[0] - before
    stop.set()
    thread.join()
    return {"took": took, "ticks_during": during}


gil = cyclone.Workflow("gil-hold")


@gil.task(timeout=timedelta(minutes=10), max_attempts=1)
def hold(ctx: cyclone.StepContext) -> dict[str, float]:
    seconds = int(ctx.input["seconds"])
    return _held(lambda: _LIBC.sleep(seconds))


crunch = cyclone.Workflow("gil-crunch")


@crunch.task(timeout=timedelta(minutes=10), max_attempts=1)
def add_up(ctx: cyclone.StepContext) -> dict[str, float]:
    n = int(ctx.input["n"])
    return _held(lambda: sum(range(n)))


hang = cyclone.Workflow("gil-hang")


@hang.task(timeout=timedelta(seconds=6), max_attempts=1)
def forever(ctx: cyclone.StepContext) -> None:
    _LIBC.sleep(3600)  # never returns in time, GIL held: only the step's timeout ends it

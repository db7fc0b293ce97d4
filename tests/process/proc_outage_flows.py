"""A one-attempt task for test_process_db_outage.py: it writes `pid monotonic-time` every 20 ms
while it runs (ignoring ctx.done), so that a test can tell its executions apart by process and
check that none overlaps the next, whatever attempt number each had."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import cyclone

once = cyclone.Workflow("outage-once")


@once.task(timeout=timedelta(minutes=1), max_attempts=1)
def run(ctx: cyclone.StepContext) -> int:
    fd = os.open(Path(ctx.input["dir"]) / "spans.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        end = time.monotonic() + ctx.input["seconds"]
        while (now := time.monotonic()) < end:
            os.write(fd, f"{os.getpid()} {now:.6f}\n".encode())
            time.sleep(0.02)
    finally:
        os.close(fd)
    return ctx.attempt

"""Handlers that write to their worker's channel, as a buggy or hostile one could (issue 22,
item 5), for test_process_worker_lines.py: the worker's own Channel is found in memory."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import cyclone
from cyclone.child.channel import Channel


def _channel_fd() -> int:
    return next(o.fd for o in gc.get_objects() if isinstance(o, Channel))


forge = cyclone.Workflow("lines-forge")


@forge.task(timeout=timedelta(seconds=3), max_attempts=1)
def write(ctx: cyclone.StepContext) -> None:
    os.write(_channel_fd(), ctx.input["line"].encode() + b"\n")
    time.sleep(30)


flood = cyclone.Workflow("lines-flood")


@flood.task(timeout=timedelta(seconds=30), max_attempts=1)
def pour(ctx: cyclone.StepContext) -> None:
    fd, chunk = _channel_fd(), b"ready\n" * 10_000
    end = time.monotonic() + 5
    while time.monotonic() < end:
        os.write(fd, chunk)

"""Workflows for test_process_reaper.py: handlers that leave processes behind, or eat memory."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import cyclone

# A daemon the classic way: fork, setsid, fork again, so that it is in no group or session of
# the worker's and its parent is gone. It ignores SIGTERM: only a SIGKILL aimed at it ends it.
_DAEMON = """
import os, signal, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def _daemonise(ctx: cyclone.StepContext) -> int:
    """Start a daemon; note the worker's pid and the daemon's; return the daemon's."""
    base = Path(ctx.input["dir"]) / f"{ctx.run_id}.{ctx.attempt}"
    daemon = base.with_suffix(base.suffix + ".daemon")
    subprocess.run([sys.executable, "-c", _DAEMON, str(daemon)], check=True)
    while not daemon.exists():
        time.sleep(0.01)
    base.with_suffix(base.suffix + ".worker").write_text(str(os.getpid()))
    return int(daemon.read_text())


escapes = cyclone.Workflow("proc-daemon-hang")


@escapes.task(timeout=timedelta(seconds=1), max_attempts=1)
def hang(ctx: cyclone.StepContext) -> None:
    _daemonise(ctx)
    while True:
        time.sleep(0.05)


leaves = cyclone.Workflow("proc-daemon-return")


@leaves.task(max_attempts=1)
def leave(ctx: cyclone.StepContext) -> int:
    return _daemonise(ctx)


hog = cyclone.Workflow("proc-memory")


@hog.task(max_attempts=1)
def allocate(ctx: cyclone.StepContext) -> list[int]:
    block = bytearray(ctx.input["mib"] << 20)
    del block
    return list(resource.getrlimit(resource.RLIMIT_DATA))

"""A workflow for test_process_secrets.py: what a handler, and what it starts, can see."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import cyclone

peek = cyclone.Workflow("proc-peek-environment")


@peek.task(max_attempts=1)
def environment(ctx: cyclone.StepContext) -> dict:
    child = subprocess.run(
        [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return {"handler": dict(os.environ), "child": json.loads(child.stdout)}


# A name and an error that would split, forge or repaint the supervisor's log lines if logged raw.
hostile = cyclone.Workflow("evil\nname\x1b[2J [/oops]")


@hostile.task(name="n\rode", max_attempts=1)
def fail_loudly(ctx: cyclone.StepContext) -> None:
    import logging

    logging.getLogger("handler").warning("handler says \x1b]0;pwned\x07\n2026-01-01 FORGED")
    raise RuntimeError("bad \x1b[31mred\x1b[0m\nFORGED second line \u202e")

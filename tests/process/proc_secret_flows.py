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

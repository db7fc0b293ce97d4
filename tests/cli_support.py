"""Shared by the CLI and status tests: workflows, running the CLI, fingerprints. No tests here."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

import cyclone
from cyclone.cli import main
from cyclone.testing import TestEnv

# The password of every DSN the tests build on purpose: it must never be printed.
SECRET = "s3cr3t-PW"
ANSI = re.compile(r"\x1b\[")

BROKEN: dict[str, bool] = {}

approve = cyclone.Workflow("cli-approve")


@approve.task()
def prepare(ctx):
    return {"n": (ctx.input or {}).get("n", 0)}


approve.wait("approval", signal="approved", after=[prepare])


@approve.task(after=["approval"])
def ship(ctx):
    return "shipped"


fragile = cyclone.Workflow("cli-fragile")


@fragile.task(max_attempts=1)
def explode(ctx):
    if BROKEN.get("explode", True):
        raise RuntimeError("boom: the 'fragile' step failed\nsecond line of the error")
    return "fine"


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def run_cli(capsys: pytest.CaptureFixture[str], env: TestEnv | None, *argv: str) -> Result:
    """`cyclone --dsn <env> ARGV...` in-process; returns the exit status and what it printed."""
    capsys.readouterr()
    args = ["--dsn", env.dsn, *argv] if env is not None else list(argv)
    code = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return Result(code, out, err)


def fingerprint(env: TestEnv) -> list[Any]:
    """Everything a command could change: any difference means it wrote something."""
    rows = env.conn.execute(
        "SELECT 'run' AS what, id::text, state, deadline_at::text, paused_at::text"
        "  FROM cyclone_runs"
        " UNION ALL "
        "SELECT 'step', id::text, state, attempt::text, coalesce(error_kind, '')"
        "  FROM cyclone_steps"
        " UNION ALL "
        "SELECT 'signal', id::text, name, consumed_by::text, '' FROM cyclone_signals"
        " ORDER BY 1, 2"
    ).fetchall()
    return [tuple(r.values()) for r in rows]


def deadline_killed(env: TestEnv) -> str:
    """A run of cli-approve parked on its wait, then failed by its deadline."""
    run_id = env.client.submit(approve, {"n": 1}, run_deadline=timedelta(hours=1))
    env.run_until_idle()
    env.advance_time(timedelta(hours=2))
    st = env.run_until_complete(run_id)
    assert st.error_kind == "deadline"
    return run_id


def failed_run(env: TestEnv) -> str:
    run_id = env.client.submit(fragile, {})
    st = env.run_until_complete(run_id)
    assert st.state == "failed"
    return run_id

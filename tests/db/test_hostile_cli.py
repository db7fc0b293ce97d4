"""The CLI and `cyclone status` on a real database holding workflow names, node names and error
text with rich markup and control characters (issue 22, item 10): shown, never obeyed."""

from __future__ import annotations

import re

from cli_support import run_cli

import cyclone
from cyclone import engine

RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
ERROR = "bad \x1b[2J\x1b]0;pwned\x07 text\r\nsecond \u202e line \x9b[/red]"

failing = cyclone.Workflow("markup[/oops] \x1b[31mred\nforged line")


@failing.task(name="n[bold]o\rde", max_attempts=1)
def boom(ctx):
    raise RuntimeError(ERROR)


waiting = cyclone.Workflow("markup[/oops] waits")
waiting.wait("w[/]a\x07it", signal="go")


def test_every_listing_and_the_status_screen_show_hostile_names(capsys, env) -> None:
    failed = env.client.submit(failing, {})
    assert env.run_until_complete(failed).state == "failed"
    parked = env.client.submit(waiting, {})
    env.run_until_idle()
    assert env.client.pause(parked)
    (step,) = env.client.steps(failed)
    # A worker of a supervisor, as `cyclone status` and `cyclone workers` read them.
    lease_run = env.client.submit(failing, {})
    lease = engine.lease_step(env.conn, worker="w", lease_ttl=30, now=env.now())
    assert lease is not None and lease.run_id == lease_run
    env.conn.execute(
        "INSERT INTO cyclone_supervisors (id, host, pid, workers_target, started_at, seen_at)"
        " VALUES ('s', %s, 1, 1, now(), now())", ("host[/x]\x1b[2J",),
    )  # fmt: skip
    env.conn.execute(
        "INSERT INTO cyclone_workers (supervisor_id, slot, pid, state, step_id, run_id,"
        " workflow, node, attempt, busy_since) VALUES ('s', 1, 2, 'busy', %s, %s, %s, %s, 1,"
        " now())", (lease.step_id, lease.run_id, failing.name, "n[bold]o\rde"),
    )  # fmt: skip
    commands = [
        ("runs",), ("run", failed), ("steps", failed), ("dlq", "list"),
        ("dlq", "attempts", str(step.id)), ("status", "--once"), ("workers",),
        ("runs", "--state", "paused"), ("steps", parked),
    ]  # fmt: skip
    shown = ""
    for argv in commands:
        result = run_cli(capsys, env, *argv)
        assert result.code == 0, (argv, result.err)
        assert not RAW.search(result.out + result.err), (argv, result.out + result.err)
        shown += result.out
    assert "markup[/oops]" in shown and "n[bold]o\\rde" in shown and "w[/]a" in shown
    assert "\\x1b[2J" in shown  # the escape shown, not sent
    # A newline in a name is shown, not obeyed: no row of its own ("forged line" in a table).
    assert "red\\nforged line" in shown
    assert not any(line.strip().startswith("forged line") for line in shown.splitlines())
    # In JSON the values are data, as they are, written with every control character, line
    # separator and bidi override escaped (\u009b, \u202e): the same JSON, safe on a terminal.
    for argv in (("steps", failed, "--json"), ("dlq", "list", "--json"), ("status", "--json")):
        result = run_cli(capsys, env, *argv)
        assert result.code == 0 and not RAW.search(result.out), (argv, result.out)
    (dead,) = run_cli(capsys, env, "dlq", "list", "--json").json()
    assert ERROR in dead["error"] and dead["workflow"] == failing.name

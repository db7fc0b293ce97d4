"""What the queue counts as due (paused runs' steps are not), and runs no supervisor serves
(issue 11, items 7 and 9): in `cyclone status`, its JSON and the database gauges of /metrics."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

import cyclone
from cyclone.child.session import connect_briefly
from cyclone.status import take_snapshot
from cyclone.status.render import render
from cyclone.supervisor.gauges import DatabaseGauges
from cyclone.supervisor.served import unserved_runs
from cyclone.testing import TestEnv

served = cyclone.Workflow("queue-served")
orphan = cyclone.Workflow("queue-orphan")


@served.task
def one(ctx: cyclone.StepContext) -> int:
    return 1


@orphan.task
def two(ctx: cyclone.StepContext) -> int:
    return 2


def gauges(env: TestEnv) -> str:
    registry = CollectorRegistry()
    registry.register(DatabaseGauges(lambda: connect_briefly(env.dsn), ttl=0))
    return generate_latest(registry).decode()


def publish(env: TestEnv, sup_id: str, workflows: list[str] | None) -> None:
    env.conn.execute(
        "INSERT INTO cyclone_supervisors (id, host, pid, workers_target, workflows)"
        " VALUES (%s, 'vm', 1, 1, %s)", [sup_id, workflows],
    )  # fmt: skip


def test_steps_of_a_paused_run_are_not_due(env: TestEnv) -> None:
    paused = env.client.submit(served, {})
    env.client.pause(paused)
    snap = take_snapshot(env.conn)
    assert (snap.queue["due"], snap.queue["oldest_due_age"]) == (0, None)
    text = gauges(env)
    assert "cyclone_steps_due 0.0" in text
    assert "cyclone_steps_due_oldest_seconds 0.0" in text
    env.client.submit(served, {})
    snap = take_snapshot(env.conn)
    assert snap.queue["due"] == 1 and snap.queue["oldest_due_age"] is not None
    assert "cyclone_steps_due 1.0" in gauges(env)
    env.client.resume(paused)
    assert take_snapshot(env.conn).queue["due"] == 2


def test_runs_of_workflows_no_live_supervisor_serves_are_named(env: TestEnv) -> None:
    env.client.submit(orphan, {})
    env.client.submit(orphan, {})
    env.client.submit(served, {})
    assert take_snapshot(env.conn).unserved == []  # no supervisor at all: another alarm
    publish(env, "sup-a", ["queue-served"])
    snap = take_snapshot(env.conn)
    version = orphan.graph.hash
    assert snap.unserved == [{"workflow": "queue-orphan", "graph_hash": version, "runs": 2}]
    assert f'cyclone_runs_unserved{{graph="{version}",workflow="queue-orphan"}} 2.0' in gauges(env)
    console = Console(width=200, record=True)
    console.print(render(snap))
    assert f"no worker serves: queue-orphan version {version[:12]} (2)" in console.export_text()
    # The asking supervisor's own list counts, its published row aside.
    assert unserved_runs(env.conn, ["queue-orphan"], "sup-a")[0]["workflow"] == "queue-served"
    # A supervisor from before the list was published serves, as far as anyone knows, all.
    publish(env, "sup-old", None)
    assert take_snapshot(env.conn).unserved == []
    assert "cyclone_runs_unserved{" not in gauges(env)


mails = cyclone.Workflow("unserved-mails", queue="emails")
mails.task(one, name="send")


def test_the_workers_listing_shows_the_queues_each_supervisor_serves(
    env: TestEnv, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli_support import run_cli

    env.register(served, mails)
    publish(env, "sup-mail", [mails.name])
    publish(env, "sup-all", None)
    publish(env, "sup-none", [])
    r = run_cli(capsys, env, "workers", "--json")
    queues = {s["id"]: s["queues"] for s in json.loads(r.out)["supervisors"]}
    assert queues == {"sup-mail": ["emails"], "sup-all": None, "sup-none": []}
    r = run_cli(capsys, env, "workers")
    assert "emails" in r.out and "every" in r.out

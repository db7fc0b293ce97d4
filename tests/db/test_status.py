"""`cyclone status` and `cyclone workers`, read from a real database with hand-seeded presence.

The supervisor publishes cyclone_supervisors / cyclone_workers itself; here the rows are
written by hand so each field of the view can be checked against a known value.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from cli_support import ANSI, approve, deadline_killed, failed_run, fingerprint, run_cli

from cyclone import engine
from cyclone.status import LOST_AFTER, take_snapshot
from cyclone.testing import TestEnv


@pytest.fixture
def cenv(env: TestEnv) -> TestEnv:
    env.register(approve)
    return env


def seed_presence(env: TestEnv) -> dict[str, object]:
    """One live supervisor on host vm-1 with a busy and an idle worker, and one lost one."""
    run_id = env.client.submit(approve, {}, run_deadline=timedelta(minutes=20))
    # On the env's clock, which is the database's until a test advances it.
    lease = engine.lease_step(env.conn, worker="vm-1:101:1", lease_ttl=30, now=env.now())
    assert lease is not None and lease.run_id == run_id
    env.conn.execute(
        "INSERT INTO cyclone_supervisors (id, host, pid, workers_target, started_at, seen_at)"
        " VALUES ('sup-a', 'vm-1', 100, 2, now() - interval '1 hour', now()),"
        "        ('sup-b', 'vm-2', 200, 1, now() - interval '2 hours', now() - interval '5 min')"
    )
    env.conn.execute(
        "INSERT INTO cyclone_workers (supervisor_id, slot, pid, state, step_id, run_id,"
        "                             workflow, node, attempt, busy_since)"
        " VALUES ('sup-a', 1, 101, 'busy', %s, %s, 'cli-approve', 'prepare', 1,"
        "         now() - interval '5 seconds'),"
        "        ('sup-a', 2, 102, 'idle', NULL, NULL, NULL, NULL, NULL, NULL)",
        (lease.step_id, run_id),
    )
    return {"run_id": run_id, "step_id": lease.step_id}


def test_workers_are_joined_to_their_step_and_run(cenv):
    seeded = seed_presence(cenv)
    snap = take_snapshot(cenv.conn)
    assert [(s["host"], s["lost"]) for s in snap.supervisors] == [("vm-1", False), ("vm-2", True)]
    busy, idle = snap.workers
    assert (busy["state"], busy["step_id"], busy["node"]) == ("busy", seeded["step_id"], "prepare")
    assert 4 <= busy["elapsed"] < 60
    assert 20 < busy["lease_left"] <= 30
    assert 19 * 60 < busy["deadline_left"] <= 20 * 60
    assert (idle["state"], idle["step_id"], idle["lease_left"]) == ("idle", None, None)
    assert snap.queue["running"] == 1
    assert LOST_AFTER < 300


def test_status_once_prints_every_section_without_ansi(capsys, cenv):
    deadline_killed(cenv)
    failed_run(cenv)
    seed_presence(cenv)
    paused = cenv.client.submit(approve, {}, run_deadline=timedelta(minutes=45))
    cenv.client.pause(paused)
    before = fingerprint(cenv)
    r = run_cli(capsys, cenv, "status", "--once")
    assert r.code == 0 and not ANSI.search(r.out)
    for text in (
        "Supervisors",
        "vm-1",
        "lost",
        "Workers",
        "cli-approve/prepare",
        "Runs",
        "DLQ by reason",
        "deadline",
        "Recent deadline failures",
        "Paused runs",
        paused,
    ):
        assert text in r.out, text
    assert r.out.count("cyclone status") == 1
    assert fingerprint(cenv) == before


def test_status_without_a_terminal_prints_one_snapshot_even_without_once(capsys, cenv):
    r = run_cli(capsys, cenv, "status")
    assert r.code == 0 and r.out.count("cyclone status") == 1
    assert "none has published itself" in r.out


def test_status_json_is_the_same_snapshot(capsys, cenv):
    killed = deadline_killed(cenv)  # moves the env's clock; the rest is seeded after it
    failed_run(cenv)
    seeded = seed_presence(cenv)
    paused = cenv.client.submit(approve, {}, run_deadline=timedelta(minutes=45))
    cenv.client.pause(paused)
    data = run_cli(capsys, cenv, "status", "--json").json()
    assert data["version"] == 1 and data["taken_at"].endswith("Z")
    assert set(data) >= {
        "supervisors", "workers", "runs", "queue", "dlq", "deadline_failures", "paused",
    }  # fmt: skip
    assert {s["host"] for s in data["supervisors"]} == {"vm-1", "vm-2"}
    [busy] = [w for w in data["workers"] if w["state"] == "busy"]
    assert busy["step_id"] == seeded["step_id"] and busy["run_id"] == seeded["run_id"]
    assert data["runs"]["live"] == {"running": 1, "paused": 1}
    assert data["runs"]["finished_recently"]["failed"] == 2
    assert data["dlq"]["total"] == 2
    assert {r["reason"]: r["steps"] for r in data["dlq"]["by_reason"]} == {
        "deadline": 1,
        "error": 1,
    }
    assert [d["run_id"] for d in data["deadline_failures"]] == [killed]
    [p] = data["paused"]["runs"]
    assert p["id"] == paused and 44 * 60 < p["frozen_left"] <= 45 * 60


def test_a_paused_runs_frozen_time_left_does_not_move(cenv):
    paused = cenv.client.submit(approve, {}, run_deadline=timedelta(minutes=10))
    cenv.client.pause(paused)
    first = take_snapshot(cenv.conn).paused[0]["frozen_left"]
    cenv.conn.execute("SELECT pg_sleep(0.05)")
    assert take_snapshot(cenv.conn).paused[0]["frozen_left"] == first


def test_workers_command_in_text_and_json(capsys, cenv):
    seeded = seed_presence(cenv)
    r = run_cli(capsys, cenv, "workers")
    assert r.code == 0 and "vm-1:100" in r.out and "cli-approve/prepare" in r.out
    assert "idle" in r.out and not ANSI.search(r.out)
    data = run_cli(capsys, cenv, "workers", "--json").json()
    assert [w["slot"] for w in data["workers"]] == [1, 2]
    assert data["workers"][0]["step_id"] == seeded["step_id"]


def test_status_of_an_empty_database_is_all_zero(capsys, cenv):
    data = run_cli(capsys, cenv, "status", "--json").json()
    assert data["supervisors"] == [] and data["workers"] == []
    assert data["dlq"] == {"total": 0, "by_reason": []}
    assert data["queue"]["due"] == 0 and data["paused"]["total"] == 0

"""Every `cyclone` command in-process against a real PostgreSQL: text, --json and exit status."""

from __future__ import annotations

import json
import re
import uuid
from datetime import timedelta

import pytest
from cli_support import (
    SECRET,
    approve,
    deadline_killed,
    failed_run,
    fingerprint,
    fragile,
    run_cli,
)

from cyclone.sql import migrations
from cyclone.states import DEADLINE_ERROR, RunState, StepState
from cyclone.testing import TestEnv


@pytest.fixture
def cenv(env: TestEnv) -> TestEnv:
    env.register(approve, fragile)
    return env


# --- the database, and how it is found ------------------------------------------------------


def test_an_unreachable_database_exits_3_without_showing_the_password(capsys):
    dsn = f"postgresql://cyclone:{SECRET}@127.0.0.1:1/cyclone"
    r = run_cli(capsys, None, "--dsn", dsn, "runs")
    assert r.code == 3
    assert "cannot reach the database" in r.err and "127.0.0.1" in r.err
    assert SECRET not in r.err + r.out
    assert "***" in r.err


def test_an_unreachable_key_value_dsn_exits_3_without_showing_the_password(capsys):
    dsn = f"host=127.0.0.1 port=1 user=cyclone password='{SECRET}' dbname=x connect_timeout=2"
    r = run_cli(capsys, None, "--dsn", dsn, "dlq", "list")
    assert r.code == 3 and SECRET not in r.err + r.out


def test_a_malformed_dsn_is_a_usage_error(capsys):
    r = run_cli(capsys, None, "--dsn", f"host=x password={SECRET} nonsense", "runs")
    assert r.code == 2 and SECRET not in r.err


def test_config_and_dsn_together_are_refused(capsys, cenv, tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text("")
    r = run_cli(capsys, cenv, "--config", str(conf), "runs")
    assert r.code == 2 and "alternatives" in r.err


def test_the_database_comes_from_the_config_file(capsys, cenv, tmp_path, monkeypatch):
    monkeypatch.delenv("CYCLONE_DATABASE_URL", raising=False)
    run_id = cenv.client.submit(approve, {})
    conf = tmp_path / "cyclone.toml"
    conf.write_text(f"[database]\nurl = {json.dumps(cenv.dsn)}\n")
    r = run_cli(capsys, None, "--config", str(conf), "runs", "--json")
    assert r.code == 0 and [x["id"] for x in r.json()] == [run_id]
    # The subcommand accepts the database options too.
    r = run_cli(capsys, None, "runs", "--config", str(conf), "--json")
    assert r.code == 0 and [x["id"] for x in r.json()] == [run_id]


def test_the_database_comes_from_the_environment(capsys, cenv, monkeypatch):
    monkeypatch.setenv("CYCLONE_DATABASE_URL", cenv.dsn)
    run_id = cenv.client.submit(approve, {})
    r = run_cli(capsys, None, "run", run_id, "--json")
    assert r.code == 0 and r.json()["id"] == run_id


def test_a_bad_config_file_exits_2_naming_the_key(capsys, tmp_path):
    conf = tmp_path / "bad.toml"
    conf.write_text("[database]\nurll = 'x'\n")
    r = run_cli(capsys, None, "--config", str(conf), "runs")
    assert r.code == 2 and "urll" in r.err and str(conf) in r.err


def test_usage_errors_exit_2_and_help_exits_0(capsys):
    assert run_cli(capsys, None).code == 2
    assert run_cli(capsys, None, "frobnicate").code == 2
    assert run_cli(capsys, None, "dlq").code == 2
    r = run_cli(capsys, None, "--help")
    assert r.code == 0 and "dlq" in r.out


def test_a_schema_without_cyclone_tables_says_to_migrate(capsys, scratch_dsn):
    dsn = scratch_dsn
    r = run_cli(capsys, None, "--dsn", dsn, "runs")
    assert r.code == 2 and "cyclone migrate" in r.err
    r = run_cli(capsys, None, "--dsn", dsn, "migrate", "--json")
    assert r.code == 0 and r.json()["applied"] == [v for v, _, _ in migrations()]
    r = run_cli(capsys, None, "--dsn", dsn, "migrate")
    assert r.code == 0 and "up to date" in r.err
    assert run_cli(capsys, None, "--dsn", dsn, "runs").code == 0


# --- submit, runs, run, steps -----------------------------------------------------------------


def test_submit_by_name_prints_the_run_id(capsys, cenv):
    r = run_cli(capsys, cenv, "submit", "cli-approve", "--input", '{"n": 5}', "--deadline", "30m")
    assert r.code == 0
    run_id = r.out.strip()
    st = cenv.client.get_run(run_id)
    assert st.input == {"n": 5}
    assert timedelta(minutes=29) < st.deadline_at - st.created_at <= timedelta(minutes=30)
    r = run_cli(capsys, cenv, "submit", "cli-approve", "--json")
    assert r.code == 0 and cenv.client.get_run(r.json()["run_id"]).input is None


def test_submit_with_a_key_twice_returns_the_first_run(capsys, cenv):
    first = run_cli(capsys, cenv, "submit", "cli-approve", "--key", "order-7").out
    again = run_cli(capsys, cenv, "submit", "cli-approve", "--key", "order-7").out
    assert first == again and len(cenv.client.steps(first.strip())) == 1


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["submit", "no-such-workflow"], 1),
        (["submit", "cli-approve", "--input", "{not json"], 2),
        (["submit", "cli-approve", "--input", "NaN"], 2),
        (["submit", "cli-approve", "--deadline", "soon"], 2),
        (["submit", "cli-approve", "--deadline", "-5m"], 2),
        (["submit", "cli-approve", "--key", ""], 2),
    ],
)
def test_submit_refuses_bad_input_and_writes_nothing(capsys, cenv, argv, code):
    before = fingerprint(cenv)
    r = run_cli(capsys, cenv, *argv)
    assert r.code == code and r.out == "" and r.err
    assert fingerprint(cenv) == before


def test_runs_lists_newest_first_and_filters(capsys, cenv):
    failed = failed_run(cenv)
    waiting = cenv.client.submit(approve, {})
    r = run_cli(capsys, cenv, "runs")
    assert r.code == 0 and r.out.index(waiting) < r.out.index(failed)
    rows = run_cli(capsys, cenv, "runs", "--json").json()
    assert [x["id"] for x in rows] == [waiting, failed]
    assert rows[1]["state"] == "failed" and rows[1]["error_kind"] == "error"
    rows = run_cli(capsys, cenv, "runs", "--state", "failed", "--json").json()
    assert [x["id"] for x in rows] == [failed]
    rows = run_cli(capsys, cenv, "runs", "--workflow", "cli-approve", "--json").json()
    assert [x["id"] for x in rows] == [waiting]
    assert len(run_cli(capsys, cenv, "runs", "--limit", "1", "--json").json()) == 1
    # Issue 27, item 9: an empty listing is one line saying so, no header over nothing; a
    # workflow that does not exist is named as such (exit 1, not found).
    r = run_cli(capsys, cenv, "runs", "--workflow", "nothing-here")
    assert r.code == 1 and r.out == ""
    assert "no workflow named 'nothing-here' is registered" in r.err
    r = run_cli(capsys, cenv, "runs", "--workflow", "cli-fragile", "--state", "paused")
    assert r.code == 0 and r.out == "" and "no runs match" in r.err
    r = run_cli(capsys, cenv, "dlq", "list", "--workflow", "nothing-here")
    assert r.code == 1 and r.out == "" and "no workflow named 'nothing-here'" in r.err
    r = run_cli(capsys, cenv, "dlq", "list", "--workflow", "cli-approve")
    assert r.code == 0 and r.out == "" and "the DLQ has no steps that match" in r.err


def test_runs_shows_a_paused_runs_time_left_frozen_as_it_was_paused(capsys, cenv):
    paused = cenv.client.submit(approve, {}, run_deadline=timedelta(hours=1))
    running = cenv.client.submit(approve, {}, run_deadline=timedelta(hours=1))
    assert run_cli(capsys, cenv, "pause", paused).code == 0
    # Both submitted, and the one paused, ten minutes ago (`runs` reads the server's clock).
    cenv.conn.execute(
        "UPDATE cyclone_runs SET created_at = created_at - interval '10 minutes',"
        " deadline_at = deadline_at - interval '10 minutes',"
        " paused_at = paused_at - interval '10 minutes'"
    )
    left = {r["id"]: r["deadline_left"] for r in run_cli(capsys, cenv, "runs", "--json").json()}
    assert 3599 <= left[paused] <= 3600  # what it had when paused, however long ago
    assert 2990 <= left[running] <= 3000  # counting down
    r = run_cli(capsys, cenv, "runs")
    assert r.code == 0
    lines = {run: next(x for x in r.out.splitlines() if run in x) for run in (paused, running)}
    assert re.search(r" 59m5\ds ", lines[paused]) and re.search(r" 49m\d+s ", lines[running])


@pytest.mark.parametrize(
    "argv",
    [
        ["runs", "--state", "running' OR '1'='1"],
        ["runs", "--limit", "0"],
        ["runs", "--limit", "10001"],
        ["runs", "--limit", "1; DROP TABLE cyclone_runs"],
        ["run", "'; DROP TABLE cyclone_runs; --"],
        ["steps", "1 OR 1=1"],
        ["cancel", "x"],
        ["dlq", "list", "--reason", "deadline' OR ''='"],
        ["dlq", "list", "--since", "1h; DELETE FROM cyclone_steps"],
        ["dlq", "list", "--limit", "-1"],
        ["dlq", "retry", "1 OR 1=1"],
        ["dlq", "retry", "0"],
        ["dlq", "retry", "٣"],
        ["signal", "not-a-run", "approved"],
        ["runs", "--workflow", "nul\x00byte"],
    ],
)
def test_hostile_values_are_usage_errors_and_change_nothing(capsys, cenv, argv):
    failed_run(cenv)
    before = fingerprint(cenv)
    r = run_cli(capsys, cenv, *argv)
    assert r.code == 2 and r.out == ""
    assert fingerprint(cenv) == before


@pytest.mark.parametrize(
    "workflow", ["x' OR '1'='1", "'; DELETE FROM cyclone_runs; --", "cli-%", "\\", '"']
)
def test_hostile_workflow_filters_match_nothing_and_change_nothing(capsys, cenv, workflow):
    failed_run(cenv)
    before = fingerprint(cenv)
    for argv in (["runs"], ["dlq", "list"]):
        r = run_cli(capsys, cenv, *argv, "--workflow", workflow, "--json")
        assert (r.code, r.json()) == (0, [])
    assert fingerprint(cenv) == before


def test_run_shows_state_error_and_output(capsys, cenv):
    run_id = failed_run(cenv)
    r = run_cli(capsys, cenv, "run", run_id)
    assert r.code == 0 and "failed" in r.out and "boom: the 'fragile' step failed" in r.out
    data = run_cli(capsys, cenv, "run", run_id, "--json").json()
    assert data["id"] == run_id and data["state"] == "failed" and data["error_kind"] == "error"
    assert data["created_at"].endswith("Z") and data["finished_at"]


def test_run_and_steps_of_an_unknown_run_exit_1(capsys, cenv):
    missing = str(uuid.uuid4())
    for cmd in ("run", "steps", "cancel", "pause", "resume"):
        r = run_cli(capsys, cenv, cmd, missing)
        assert r.code == 1 and missing in r.err, cmd


def test_steps_shows_every_step_of_a_killed_run_error_text_and_all(capsys, cenv):
    run_id = deadline_killed(cenv)
    r = run_cli(capsys, cenv, "steps", run_id)
    assert r.code == 0
    assert "prepare" in r.out and "approval" in r.out and DEADLINE_ERROR in r.out
    steps = run_cli(capsys, cenv, "steps", run_id, "--json").json()
    assert [(s["node"], s["state"], s["error_kind"], s["error"]) for s in steps] == [
        ("prepare", "completed", None, None),
        ("approval", "dead", "deadline", DEADLINE_ERROR),
    ]
    failed = failed_run(cenv)
    [step] = run_cli(capsys, cenv, "steps", failed, "--json").json()
    assert "second line of the error" in step["error"]
    assert "second line of the error" in run_cli(capsys, cenv, "steps", failed).out


# --- control ----------------------------------------------------------------------------------


def test_pause_resume_cancel_change_the_run_once(capsys, cenv):
    run_id = cenv.client.submit(approve, {}, run_deadline=timedelta(hours=1))
    r = run_cli(capsys, cenv, "pause", run_id)
    assert r.code == 0 and "paused" in r.err
    assert cenv.client.get_run(run_id).state == RunState.PAUSED
    assert run_cli(capsys, cenv, "pause", run_id).code == 1
    r = run_cli(capsys, cenv, "resume", run_id, "--json")
    assert r.code == 0 and r.json() == {"run_id": run_id, "changed": True}
    assert run_cli(capsys, cenv, "resume", run_id).code == 1
    assert run_cli(capsys, cenv, "cancel", run_id).code == 0
    assert cenv.client.get_run(run_id).state == RunState.CANCELLED
    r = run_cli(capsys, cenv, "cancel", run_id)
    assert r.code == 1 and "cancelled" in r.err


def test_signal_reaches_the_wait_and_a_finished_run_refuses_it(capsys, cenv):
    run_id = cenv.client.submit(approve, {})
    cenv.run_until_idle()
    r = run_cli(capsys, cenv, "signal", run_id, "approved", "--payload", '{"by": "ops"}')
    assert r.code == 0 and "sent" in r.err
    assert cenv.run_until_complete(run_id).state == RunState.COMPLETED
    r = run_cli(capsys, cenv, "signal", run_id, "approved")
    assert r.code == 1 and "completed" in r.err
    assert run_cli(capsys, cenv, "signal", run_id, "approved", "--payload", "{").code == 2
    assert run_cli(capsys, cenv, "signal", run_id, "").code == 2


# --- the DLQ ----------------------------------------------------------------------------------


def test_dlq_list_reason_deadline_selects_every_step_killed_by_a_run_deadline(capsys, cenv):
    killed = deadline_killed(cenv)
    failed_run(cenv)
    r = run_cli(capsys, cenv, "dlq", "list", "--reason", "deadline")
    assert r.code == 0 and killed in r.out and DEADLINE_ERROR in r.out
    rows = run_cli(capsys, cenv, "dlq", "list", "--reason", "deadline", "--json").json()
    assert [(x["run_id"], x["node"], x["error"]) for x in rows] == [
        (killed, "approval", DEADLINE_ERROR)
    ]
    everything = run_cli(capsys, cenv, "dlq", "list", "--json").json()
    assert {x["error_kind"] for x in everything} == {"deadline", "error"}
    by_flow = run_cli(capsys, cenv, "dlq", "list", "--workflow", "cli-fragile", "--json").json()
    assert [x["workflow"] for x in by_flow] == ["cli-fragile"]
    # The database clock is real here: both died moments ago, none a day from now.
    assert len(run_cli(capsys, cenv, "dlq", "list", "--since", "1h", "--json").json()) == 2
    r = run_cli(capsys, cenv, "dlq", "list", "--reason", "timeout")
    assert r.code == 0 and "no steps" in r.err


def test_dlq_retry_refuses_a_deadline_run_without_a_new_deadline(capsys, cenv):
    run_id = deadline_killed(cenv)
    [step] = [s for s in cenv.client.steps(run_id) if s.state == StepState.DEAD]
    before = fingerprint(cenv)
    r = run_cli(capsys, cenv, "dlq", "retry", str(step.id))
    assert r.code == 1 and "--deadline" in r.err
    assert fingerprint(cenv) == before


def test_dlq_retry_with_a_deadline_re_drives_the_run_to_completion(capsys, cenv):
    run_id = deadline_killed(cenv)
    [step] = [s for s in cenv.client.steps(run_id) if s.state == StepState.DEAD]
    # The env's clock is two hours ahead of the database's: three hours leaves one.
    r = run_cli(capsys, cenv, "dlq", "retry", str(step.id), "--deadline", "3h")
    assert r.code == 0 and r.out.strip() == run_id and "running again" in r.err
    st = cenv.client.get_run(run_id)
    assert (st.state, st.finished_at) == (RunState.RUNNING, None)
    assert run_cli(capsys, cenv, "dlq", "list", "--json").json() == []
    assert run_cli(capsys, cenv, "dlq", "retry", str(step.id)).code == 1
    cenv.client.signal(run_id, "approved")
    assert cenv.run_until_complete(run_id).state == RunState.COMPLETED


def test_dlq_retry_json_and_refusals(capsys, cenv):
    from cli_support import BROKEN

    run_id = failed_run(cenv)
    [step] = cenv.client.steps(run_id)
    assert run_cli(capsys, cenv, "dlq", "retry", str(step.id), "--deadline", "0").code == 2
    assert run_cli(capsys, cenv, "dlq", "retry", "999999999").code == 1
    r = run_cli(capsys, cenv, "dlq", "retry", str(step.id), "--json")
    assert r.code == 0
    assert r.json() == {
        "run_id": run_id,
        "workflow": "cli-fragile",
        "deadline_at": None,
        "step_ids": [step.id],
    }
    BROKEN["explode"] = False
    try:
        st = cenv.run_until_complete(run_id)
    finally:
        BROKEN.clear()
    assert (st.state, st.output) == (RunState.COMPLETED, {"explode": "fine"})

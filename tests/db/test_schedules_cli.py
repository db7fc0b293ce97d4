"""`cyclone schedules list|show|pause|resume|trigger|backfill|delete` in-process against a real
PostgreSQL: text at 80 columns, --json, exit statuses."""

from __future__ import annotations

from datetime import timedelta

import pytest
from cli_support import approve, run_cli

from cyclone import engine
from cyclone.testing import TestEnv


@pytest.fixture
def senv(env: TestEnv, monkeypatch) -> TestEnv:
    monkeypatch.setenv("COLUMNS", "80")
    env.register(approve)
    env.client.schedule(
        "nightly-report-for-the-finance-team", approve, cron="0 2 * * *",
        timezone="Europe/Berlin", input={"n": 1},
    )  # fmt: skip
    env.client.schedule("poll", approve, every=timedelta(minutes=5), overlap="allow_all")
    return env


def test_list_fits_80_columns_and_names_every_schedule(capsys, senv) -> None:
    r = run_cli(capsys, senv, "schedules", "list")
    assert r.code == 0, r.err
    assert "nightly-report-for-the-finance-team" in r.out and "poll" in r.out
    assert "0 2 * * *" in r.out and "every 5m00s" in r.out
    # A table (not one record per row): the header names the columns kept.
    assert r.out.splitlines()[0].split()[:3] == ["schedule", "workflow", "when"]
    assert max(len(line) for line in r.out.splitlines()) <= 80


def test_list_json(capsys, senv) -> None:
    r = run_cli(capsys, senv, "schedules", "list", "--json")
    got = {s["name"]: s for s in r.json()}
    assert got["poll"]["every"] == 300.0 and got["poll"]["overlap"] == "allow_all"
    assert got["nightly-report-for-the-finance-team"]["timezone"] == "Europe/Berlin"
    assert got["poll"]["next_tick_at"].endswith("Z")


def test_show_lists_the_next_ticks(capsys, senv) -> None:
    r = run_cli(capsys, senv, "schedules", "show", "poll", "--json")
    got = r.json()
    assert len(got["next_ticks"]) == 5 and got["next_ticks"][0] == got["next_tick_at"]
    r = run_cli(capsys, senv, "schedules", "show", "nightly-report-for-the-finance-team")
    assert r.code == 0 and "next ticks" in r.out and "skip" in r.out
    assert max(len(line) for line in r.out.splitlines()) <= 80


def test_pause_resume_trigger_delete(capsys, senv) -> None:
    assert run_cli(capsys, senv, "schedules", "pause", "poll").code == 0
    assert engine.get_schedule(senv.conn, "poll").paused
    assert run_cli(capsys, senv, "schedules", "resume", "poll").code == 0
    assert not engine.get_schedule(senv.conn, "poll").paused
    r = run_cli(capsys, senv, "schedules", "trigger", "poll", "--json")
    run_id = r.json()["run_id"]
    assert senv.client.get_run(run_id).workflow == "cli-approve"
    assert run_cli(capsys, senv, "schedules", "delete", "poll").code == 0
    r = run_cli(capsys, senv, "schedules", "delete", "poll")
    assert r.code == 1 and "no schedule 'poll'" in r.err


def test_a_skipped_trigger_says_why(capsys, senv) -> None:
    name = "nightly-report-for-the-finance-team"
    assert run_cli(capsys, senv, "schedules", "trigger", name).code == 0
    r = run_cli(capsys, senv, "schedules", "trigger", name)
    assert r.code == 0 and "overlap policy skip: no run started" in r.err


def test_backfill_starts_the_ticks_of_a_past_range(capsys, senv) -> None:
    r = run_cli(capsys, senv, "schedules", "backfill", "poll",
                "2026-01-01T00:00Z", "2026-01-01T00:20Z", "--json")  # fmt: skip
    assert r.code == 0, r.err
    assert len(r.json()["run_ids"]) == 4


@pytest.mark.parametrize(
    ("argv", "code", "said"),
    [
        (["schedules", "show", "nope"], 1, "no schedule 'nope'"),
        (["schedules", "pause", "nope"], 1, "no schedule 'nope'"),
        (["schedules", "trigger", "nope"], 1, "no schedule 'nope'"),
        (["schedules", "backfill", "poll", "2026-01-01", "2026-01-02T00:00Z"], 2, "zone"),
        (["schedules", "backfill", "poll", "yesterday", "2026-01-02T00:00Z"], 2, "ISO"),
        (["schedules", "backfill", "poll", "2026-01-02T00:00Z", "2026-01-01T00:00Z"], 2, "after"),
    ],
)
def test_bad_input_exits_with_one_line(capsys, senv, argv, code, said) -> None:
    r = run_cli(capsys, senv, *argv)
    assert r.code == code and said in r.err
    assert len(r.err.strip().splitlines()) == 1 or code == 2


# --- the status view: the next ticks -------------------------------------------------------


def test_status_shows_the_next_ticks_at_80x24_and_in_full(senv) -> None:
    import io

    from rich.console import Console

    from cyclone.status.render import render
    from cyclone.status.snapshot import take_snapshot

    snap = take_snapshot(senv.conn)
    # Soonest first: the 5-minute poll before the nightly report.
    assert [s["name"] for s in snap.schedules] == ["poll", "nightly-report-for-the-finance-team"]
    assert 0 < snap.schedules[0]["due_in"] <= 300
    small = Console(file=io.StringIO(), width=80, height=24)
    small.print(render(snap, width=80, height=24))
    lines = small.file.getvalue().splitlines()
    (ticks,) = [line for line in lines if line.startswith("ticks")]
    assert ticks.startswith("ticks  poll in ") and len(ticks) <= 80
    wide = Console(file=io.StringIO(), width=200)
    wide.print(render(snap, width=200))
    text = wide.file.getvalue()
    assert "Next schedule ticks" in text and "nightly-report-for-the-finance-team" in text
    senv.client.pause_schedule("poll")
    assert [s["name"] for s in take_snapshot(senv.conn).schedules] == [
        "nightly-report-for-the-finance-team"
    ]


def test_status_json_has_the_schedules(capsys, senv) -> None:
    data = run_cli(capsys, senv, "status", "--json").json()
    assert [s["name"] for s in data["schedules"]] == ["poll", "nightly-report-for-the-finance-team"]

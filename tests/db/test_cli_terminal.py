"""What an operator reads on a terminal of 80 columns and of 200: ids and error text whole.

The listings (`runs`, `steps`, `dlq list`, `workers`) are printed at fixed widths, through the
CLI with COLUMNS set, and every id and error text they hold must appear unbroken in what was
printed. `steps` on a big run, `run` with a big input, every message's prefix, and
`submit --input @FILE|-` are here too.
"""

from __future__ import annotations

import io
import json
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

import cyclone
from cyclone.cli.runs import SUMMARY_OVER
from cyclone.display import Column, print_listing
from cyclone.sql import QUERIES
from cyclone.states import DEADLINE_ERROR
from cyclone.testing import TestEnv

WIDTHS = (80, 200)

fan = cyclone.Workflow("cli-fan-out-with-a-long-workflow-name")


@fan.task()
def plan(ctx):
    return list(range((ctx.input or {}).get("n", 3)))


@fan.map(after=[plan], items=lambda ctx: ctx.results["plan"])
def item(ctx):
    return ctx.item


parent = cyclone.Workflow("cli-parent")
parent.child("approve-it", approve)


@pytest.fixture
def cenv(env: TestEnv) -> TestEnv:
    env.register(approve, fragile, fan, parent)
    return env


@pytest.fixture(params=WIDTHS)
def width(request, monkeypatch) -> int:
    monkeypatch.setenv("COLUMNS", str(request.param))
    return request.param


def lines_of(text: str) -> list[str]:
    return text.splitlines()


def assert_whole(out: str, *values: Any) -> None:
    """Each value appears unbroken: ids on one line, each line of an error text on one line."""
    for value in values:
        for line in str(value).strip().splitlines():
            assert line.strip() in out, f"not whole in the output: {line!r}\n{out}"


def assert_fits_or_is_a_record(out: str, width: int) -> None:
    """A table never runs past the width; only a record's value may (the terminal wraps it)."""
    for line in lines_of(out):
        if len(line) > width:
            assert "-[ 1 ]" in out, f"a table line wider than {width}: {line!r}"


# --- the listing itself, at any width -----------------------------------------------------------

ids = st.uuids().map(str)
errors = st.text(
    st.characters(codec="ascii", categories=["L", "N", "P", "Zs"]), min_size=1, max_size=150
).filter(lambda t: t.strip() == t and t)

times = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    width=st.integers(min_value=30, max_value=220),
    rows=st.lists(st.tuples(ids, errors, times), min_size=1, max_size=6),
)
def test_a_listing_never_cuts_or_folds_an_id_or_an_error_at_any_width(width, rows):
    out = Console(file=io.StringIO(), width=width, highlight=False)
    shown = print_listing(
        out,
        [Column("run"), Column("error"), Column("created", drop=1)],
        rows,
    )
    text = out.file.getvalue()
    for run_id, error, _ in rows:
        assert_whole(text, run_id, error)
    if shown.layout == "table":
        assert max(len(line) for line in lines_of(text)) <= width
    else:
        assert text.count("-[ ") == len(rows)


def test_a_listing_drops_timestamps_before_turning_into_records():
    row = (str(uuid.uuid4()), "ok", "2026-12-01 12:00:00Z")
    columns = [Column("run"), Column("state"), Column("created", drop=1)]
    narrow = Console(file=io.StringIO(), width=50)
    assert print_listing(narrow, columns, [row]).hidden == ("created",)
    wide = Console(file=io.StringIO(), width=80)
    assert print_listing(wide, columns, [row]).hidden == ()
    tiny = Console(file=io.StringIO(), width=30)
    assert print_listing(tiny, columns, [row]).layout == "records"
    assert_whole(tiny.file.getvalue(), *row)


def test_markup_like_text_in_a_value_is_shown_as_it_is():
    error = "KeyError: [bold]missing[/bold] [x]"
    out = Console(file=io.StringIO(), width=200)
    print_listing(out, [Column("error")], [(error,)])
    assert error in out.file.getvalue()


# --- runs, steps, dlq list at 80 and 200 columns --------------------------------------------------


def test_runs_show_every_run_id_and_error_kind_whole(capsys, cenv, width):
    failed = failed_run(cenv)
    killed = deadline_killed(cenv)
    waiting = cenv.client.submit(approve, {}, run_deadline=timedelta(hours=3))
    r = run_cli(capsys, cenv, "runs")
    assert r.code == 0
    assert_whole(r.out, failed, killed, waiting, "deadline", "error")
    assert_fits_or_is_a_record(r.out, width)
    if width == 80:  # the timestamps went first, and the operator is told so
        assert "created" not in r.out and "not shown at 80 columns: created" in r.err
    else:
        assert "created" in r.out and r.err == ""


def test_steps_show_step_ids_errors_and_child_runs_whole(capsys, cenv, width):
    killed = deadline_killed(cenv)
    r = run_cli(capsys, cenv, "steps", killed)
    assert r.code == 0
    steps = run_cli(capsys, cenv, "steps", killed, "--json").json()
    assert_whole(r.out, *(s["id"] for s in steps), DEADLINE_ERROR, "approval", "deadline")
    assert_fits_or_is_a_record(r.out, width)

    failed = failed_run(cenv)
    [step] = run_cli(capsys, cenv, "steps", failed, "--json").json()
    r = run_cli(capsys, cenv, "steps", failed)
    assert_whole(r.out, step["error"])  # every line of the traceback, each one whole

    run_id = cenv.client.submit(parent, {})
    cenv.run_until_idle()
    [child] = [s for s in run_cli(capsys, cenv, "steps", run_id, "--json").json()]
    assert child["child_run_id"]
    r = run_cli(capsys, cenv, "steps", run_id)
    assert "child run" in r.out
    assert_whole(r.out, child["child_run_id"])
    assert_fits_or_is_a_record(r.out, width)


def test_dlq_list_shows_step_and_run_ids_and_errors_whole(capsys, cenv, width):
    killed = deadline_killed(cenv)
    failed = failed_run(cenv)
    r = run_cli(capsys, cenv, "dlq", "list")
    assert r.code == 0
    dead = run_cli(capsys, cenv, "dlq", "list", "--json").json()
    assert {d["run_id"] for d in dead} == {killed, failed}
    assert_whole(r.out, *(d["id"] for d in dead), killed, failed, DEADLINE_ERROR)
    assert_whole(r.out, "RuntimeError: boom: the 'fragile' step failed")
    assert_fits_or_is_a_record(r.out, width)


def test_a_run_id_never_wraps_at_100_columns(capsys, cenv, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    run_ids = [cenv.client.submit(approve, {}, run_deadline=timedelta(hours=1)) for _ in range(3)]
    r = run_cli(capsys, cenv, "runs")
    assert_whole(r.out, *run_ids)
    assert "deadline left" in r.out  # only what did not fit went


# --- steps of a big run ---------------------------------------------------------------------------


def big_run(env: TestEnv, n: int) -> str:
    """A run of `fan` with its plan done and n map items, one of them completed."""
    run_id = env.client.submit(fan, {"n": n})
    while sum(s.state == "completed" for s in env.client.steps(run_id)) < 2:
        assert env.run_one()
    return run_id


def test_steps_of_a_big_run_are_counted_by_node_and_state(capsys, cenv, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    n = SUMMARY_OVER + 20
    run_id = big_run(cenv, n)
    r = run_cli(capsys, cenv, "steps", run_id)
    assert r.code == 0
    assert len(lines_of(r.out)) < 10, r.out
    header = lines_of(r.out)[0].split()
    rows = {line.split()[0]: line.split() for line in lines_of(r.out)[2:]}
    assert header == ["node", "kind", "steps", "available", "completed"]
    assert rows == {
        "plan": ["plan", "task", "1", "1"],  # no available ones: an empty cell
        "item": ["item", "map", str(n), str(n - 1), "1"],
    }
    assert f"{n + 1} steps" in r.err and "--state" in r.err
    summary = run_cli(capsys, cenv, "steps", run_id, "--summary", "--json").json()
    assert {(s["node"], s["state"]): s["steps"] for s in summary} == {
        ("plan", "completed"): 1,
        ("item", "completed"): 1,
        ("item", "available"): n - 1,
    }


def test_steps_state_and_limit_pick_the_steps_to_list(capsys, cenv):
    n = SUMMARY_OVER + 20
    run_id = big_run(cenv, n)
    done = run_cli(capsys, cenv, "steps", run_id, "--state", "completed", "--json").json()
    assert [(s["node"], s["state"]) for s in done] == [("plan", "completed"), ("item", "completed")]
    first = run_cli(capsys, cenv, "steps", run_id, "--limit", "5", "--json").json()
    assert len(first) == 5 and [s["id"] for s in first] == sorted(s["id"] for s in first)
    r = run_cli(capsys, cenv, "steps", run_id, "--limit", "5")
    assert_whole(r.out, *(s["id"] for s in first))
    assert f"the first 5 of {n + 1} steps" in r.err
    r = run_cli(capsys, cenv, "steps", run_id, "--state", "dead")
    assert r.code == 0 and "no dead steps" in r.err
    everything = run_cli(capsys, cenv, "steps", run_id, "--json").json()
    assert len(everything) == n + 1  # --json lists every step unless told otherwise
    for bad in (["--limit", "0"], ["--state", "dead' OR '1'='1"]):
        assert run_cli(capsys, cenv, "steps", run_id, *bad).code == 2


def test_the_steps_reads_are_served_by_the_run_id_index(cenv):
    run_id = big_run(cenv, 5)
    with cenv.conn.transaction():
        cenv.conn.execute("SET LOCAL enable_seqscan = off")
        for name, params in (
            ("run_steps_summary", {"run_id": run_id}),
            ("run_steps_page", {"run_id": run_id, "state": None, "limit": 10}),
        ):
            plan = cenv.conn.execute("EXPLAIN " + QUERIES[name], params).fetchall()
            text = "\n".join(next(iter(r.values())) for r in plan)
            assert "cyclone_steps_node_idx" in text and "Seq Scan" not in text, text


# --- run, messages, submit --input ---------------------------------------------------------------


def test_run_keeps_field_names_whole_beside_a_large_input(capsys, cenv, width):
    big = {"rows": [{"sku": f"SKU-{i:05d}", "qty": i} for i in range(200)]}
    run_id = cenv.client.submit(approve, big)
    r = run_cli(capsys, cenv, "run", run_id)
    assert r.code == 0
    names = [line.split()[0] for line in lines_of(r.out) if line and not line.startswith(" ")]
    assert names == [
        "id", "workflow", "state", "input", "output", "error_kind", "error",
        "parent_run_id", "created_at", "deadline_at", "paused_at", "finished_at",
    ]  # fmt: skip
    assert_whole(r.out, run_id, "SKU-00000")
    assert "characters: --json shows them all" in r.out  # the input was cut, and says so
    failed = failed_run(cenv)
    r = run_cli(capsys, cenv, "run", failed)
    assert_whole(r.out, cenv.client.get_run(failed).error)


def test_every_message_carries_the_cyclone_prefix(capsys, cenv, tmp_path):
    run_id = cenv.client.submit(approve, {}, run_deadline=timedelta(hours=1))
    cenv.run_until_idle()
    failed = failed_run(cenv)
    [step] = cenv.client.steps(failed)
    missing = str(uuid.uuid4())
    commands = [
        ["pause", run_id],
        ["pause", run_id],
        ["resume", run_id],
        ["signal", run_id, "nobody-waits"],
        ["cancel", run_id],
        ["cancel", run_id],
        ["signal", run_id, "approved"],
        ["run", missing],
        ["runs", "--workflow", "nothing-here"],
        ["dlq", "list", "--reason", "timeout"],
        ["dlq", "retry", str(step.id)],
        ["migrate"],
        ["steps", failed, "--state", "running"],
        ["submit", "no-such-workflow"],
    ]
    for argv in commands:
        r = run_cli(capsys, cenv, *argv)
        assert r.err, argv
        for line in lines_of(r.err):
            assert line.startswith("cyclone: ") and not line.startswith("cyclone: cyclone:"), (
                argv,
                line,
            )


def test_submit_input_from_a_file_and_from_stdin(capsys, cenv, tmp_path, monkeypatch):
    doc = {"n": 7, "note": "from a file", "nested": {"k": [1, 2]}}
    path = tmp_path / "input.json"
    path.write_text(json.dumps(doc, indent=2))
    r = run_cli(capsys, cenv, "submit", "cli-approve", "--input", f"@{path}")
    assert r.code == 0 and cenv.client.get_run(r.out.strip()).input == doc
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"from": "stdin"}')))
    r = run_cli(capsys, cenv, "submit", "cli-approve", "--input", "-")
    assert r.code == 0 and cenv.client.get_run(r.out.strip()).input == {"from": "stdin"}
    run_id = r.out.strip()
    cenv.run_until_idle()
    payload = tmp_path / "payload.json"
    payload.write_text('{"by": "ops"}')
    r = run_cli(capsys, cenv, "signal", run_id, "approved", "--payload", f"@{payload}")
    assert r.code == 0


def test_submit_input_from_a_bad_file_is_one_clear_usage_error(capsys, cenv, tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text('{"n": 1,')
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"name": "\xe9"}')
    cases = {
        f"@{tmp_path / 'missing.json'}": "No such file",
        f"@{bad}": "not JSON",
        f"@{latin}": "not UTF-8",
        f"@{tmp_path}": "directory",
        "@": "a file name after the @",
    }
    before = fingerprint(cenv)
    for value, why in cases.items():
        r = run_cli(capsys, cenv, "submit", "cli-approve", "--input", value)
        assert r.code == 2 and r.out == "", value
        [error] = [line for line in lines_of(r.err) if "error:" in line]
        assert "--input" in error and why in error, error
        if value != "@":
            assert value[1:] in error  # names the file
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"[1, 2")))
    r = run_cli(capsys, cenv, "submit", "cli-approve", "--input", "-")
    assert r.code == 2 and "stdin: not JSON" in r.err
    assert fingerprint(cenv) == before
    assert SECRET not in r.err

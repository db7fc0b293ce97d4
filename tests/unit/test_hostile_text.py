"""Names and errors with rich markup and control characters are shown, never obeyed (issue 22,
item 10): no markup error, no escape sequence or stray line break reaches a terminal or a log."""

from __future__ import annotations

import io
import json
import logging
import re
from datetime import UTC, datetime

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from rich.console import Console

from cyclone.display import Column, print_listing, records, table
from cyclone.sanitize import SafeRecords, printable, printable_lines
from cyclone.status.compact import render_compact
from cyclone.status.render import render
from cyclone.status.snapshot import Snapshot
from cyclone.supervisor.__main__ import JsonFormatter

# What must never reach a terminal raw: C0 controls but the line break, DEL, C1 controls,
# the Unicode line separators and the bidi overrides and isolates.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
HOSTILE = "markup[/oops] [bold red]x[/] \x1b[2J\x1b]0;pwned\x07 cr\rlf\nnul\x00 \u202eevil"

texts = st.one_of(
    st.just(HOSTILE),
    st.text(st.sampled_from("[]/\\=#@bold red x\x1b\x07\r\n\t\x00\x9b\u2028\u202e"), max_size=40),
    st.text(max_size=40),
)


def console(width: int = 200) -> tuple[Console, io.StringIO]:
    # markup on (rich's default): the code, not the console, must keep text out of the parser.
    out = io.StringIO()
    return Console(file=out, width=width, markup=True, color_system=None), out


def snapshot(name: str) -> Snapshot:
    """Every section holding `name` where a name, host or id goes (rows shaped as
    take_snapshot reads them)."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    worker = {
        "supervisor_id": "s", "slot": 1, "pid": 7, "state": "busy", "step_id": 9,
        "run_id": name, "workflow": name, "node": name, "attempt": 1, "item_index": None,
        "step_state": "running", "run_state": "running", "busy_since": now, "elapsed": 1.0,
        "lease_left": 20.0, "deadline_left": None, "seen_ago": 0.1,
    }  # fmt: skip
    supervisor = {
        "id": "s", "host": name, "pid": 1, "state": "running", "workers_target": 1,
        "started_at": now, "seen_at": now, "up_for": 10.0, "seen_ago": 0.5, "lost": False,
    }  # fmt: skip
    return Snapshot(
        taken_at=now, supervisors=[supervisor], workers=[worker],
        runs_live={"running": 1, "paused": 1}, runs_finished={"failed": 1},
        finished_window_seconds=3600.0,
        queue={"due": 0, "due_capped": False, "oldest_due_age": None, "running": 1},
        dlq=[{"reason": name, "steps": 1, "newest": now}],
        deadline_failures=[{"run_id": name, "workflow": name, "steps": 1, "ago": 5.0}],
        paused=[{"id": name, "workflow": name, "paused_at": now, "deadline_at": None,
                 "paused_for": 3.0, "frozen_left": None}],
        paused_total=1, unserved=[{"workflow": name, "runs": 2}],
    )  # fmt: skip


def assert_clean(output: str) -> None:
    assert not RAW.search(output), repr(output)


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts)
def test_tables_listings_and_records_show_any_text_and_obey_none(text: str) -> None:
    con, out = console()
    t = table("t", ["workflow", "error"])
    t.add_row(text, text)
    con.print(t)
    con.print(table("t", ["workflow"], [[text]]))
    print_listing(con, [Column("workflow"), Column("error")], [(text, text)])
    narrow, narrow_out = console(width=20)  # too narrow for a table: records
    print_listing(narrow, [Column("workflow"), Column("error")], [(text, text * 3)])
    # `cyclone run` prints values that did not come through a listing's cells.
    con.print(records([Column("input")], [[text]], numbered=False), soft_wrap=True)
    assert_clean(out.getvalue() + narrow_out.getvalue())


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts)
def test_the_status_screen_shows_any_name_in_both_layouts(text: str) -> None:
    for width, height in ((200, None), (60, 20)):  # the tables, then the compact layout
        con, out = console(width)
        con.print(render(snapshot(text), problem=text, width=width, height=height))
        con.print(render_compact(snapshot(text), problem=text, width=width, height=height))
        assert_clean(out.getvalue())


def test_a_markup_name_is_shown_as_written() -> None:
    con, out = console()
    con.print(render(snapshot("markup[/oops]"), width=200))
    assert "markup[/oops]" in out.getvalue()
    con, out = console()
    print_listing(con, [Column("workflow")], [("[bold]loud[/bold]",)])
    assert "[bold]loud[/bold]" in out.getvalue()

    # A name's newline is shown, in a listing, a record and a table; an error keeps its lines.
    con, out = console()
    print_listing(con, [Column("workflow"), Column("error", first_line=True)], [("a\nb", "x\ny")])
    con.print(records([Column("workflow"), Column("error", lines=True)], [["a\nb", "x\ny"]]))
    t = table("t", ["workflow"])
    t.add_row("a\nb")
    con.print(t)
    lines = out.getvalue().splitlines()
    assert sum("a\\nb" in line for line in lines) == 3
    assert any(line.strip() == "y" for line in lines)  # the error's second line, in the record


def test_escapes_are_visible_and_line_breaks_kept_where_text_has_lines() -> None:
    assert printable("a\nb\x1b[2J\tc\u202e") == "a\\nb\\x1b[2J\\tc\\u202e"
    assert printable_lines("first\nsecond\x07") == "first\nsecond\\x07"
    # Idempotent: a value escaped twice (a listing's cell, then its record) reads the same.
    assert printable(printable(HOSTILE)) == printable(HOSTILE)


@hsettings(max_examples=100, deadline=None)
@given(text=texts)
def test_a_log_record_is_one_line_whatever_it_quotes(text: str) -> None:
    for formatter in (logging.Formatter("%(levelname)s %(message)s"), JsonFormatter()):
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(formatter)
        handler.addFilter(SafeRecords())
        logger = logging.getLogger("test_hostile_text")
        logger.propagate, logger.handlers[:] = False, [handler]
        logger.warning("step %s failed: %s", text, text)
        logger.handlers[:] = []
        line = stream.getvalue()
        assert line.count("\n") == 1 and line.endswith("\n")
        assert_clean(line[:-1])
        if isinstance(formatter, JsonFormatter):
            json.loads(line)

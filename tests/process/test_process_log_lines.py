"""The supervisor's log, and what its workers and their handlers log, stays one line per event
with control characters escaped, whatever names and errors hold (issue 22, item 10)."""

from __future__ import annotations

import re

from proc_helpers import terminal, wait_for

RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \[\d+\] ")


def test_a_hostile_name_and_error_leave_one_escaped_line_each(env, supervisor) -> None:
    from proc_secret_flows import hostile

    sup = supervisor(workflows__modules='["proc_secret_flows"]')
    run_id = env.client.submit(hostile, {})
    status = wait_for(lambda: terminal(env, run_id), 15, "the run to fail")
    assert "FORGED" in status.error  # the database keeps the error as raised
    wait_for(lambda: "dead-lettered" in sup.log(), 5, "the step's outcome in the log")
    log = sup.log()
    assert not RAW.search(log), repr(RAW.search(log))
    for line in log.splitlines():
        assert LINE.match(line) or line.startswith("  "), repr(line)  # nothing forged
    assert "FORGED" not in "".join(line for line in log.splitlines() if LINE.match(line) is None)
    assert "evil\\nname\\x1b[2J [/oops]/n\\rode" in log
    assert "RuntimeError: bad \\x1b[31mred\\x1b[0m" in log
    assert "handler says \\x1b]0;pwned\\x07\\n2026-01-01 FORGED" in log

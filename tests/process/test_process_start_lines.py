"""What a supervisor says as it starts (issue 27, item 13): `modules = []` is a warning (its
workers would lease nothing, silently)."""

from __future__ import annotations

from proc_helpers import wait_for


def test_an_empty_modules_list_is_a_warning(env, supervisor) -> None:
    sup = supervisor(workflows__modules="[]")
    line = wait_for(
        lambda: [x for x in sup.log().splitlines() if "[workflows] modules is empty" in x], 10,
        sup.log(),
    )[0]  # fmt: skip
    assert "WARNING" in line and "lease nothing" in line


def test_listed_modules_are_no_warning(env, supervisor) -> None:
    sup = supervisor()
    wait_for(lambda: "workflows: " in sup.log(), 10, sup.log())
    assert "modules is empty" not in sup.log()

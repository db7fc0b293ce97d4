"""Filter fuzzing: any text for --reason, RUN_ID, STEP_ID, --workflow, --since and --limit gets
a usage error (2) or the correct answer, never a database error, and never changes anything."""

from __future__ import annotations

from datetime import timedelta

import pytest
from cli_support import approve, deadline_killed, failed_run, fingerprint, fragile, run_cli
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from cyclone.durations import parse_duration
from cyclone.states import DEAD_KINDS
from cyclone.testing import TestEnv

# The kinds a dead step may have: `cancelled` is refused (issue 27, item 8).
KINDS = {k.value for k in DEAD_KINDS}
FUZZ = settings(
    max_examples=60,
    deadline=None,
    # The env is shared on purpose: the property is that no example changes it.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# Plain text, SQL-ish text, and values close to valid ones.
hostile = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["' OR '1'='1", "'; DROP TABLE cyclone_steps; --", "deadline'", "1h'; --", "%", "\\x00"]
    ),
    st.builds(lambda k, s: k + s, st.sampled_from(sorted(KINDS)), st.text(max_size=5)),
)


@pytest.fixture
def seeded(env: TestEnv) -> tuple[TestEnv, list]:
    env.register(approve, fragile)
    deadline_killed(env)
    failed_run(env)
    return env, fingerprint(env)


def check(capsys, env, before, *argv: str):
    r = run_cli(capsys, env, *argv)
    assert r.code in (0, 1, 2), r.err
    assert "syntax error" not in r.err.lower() and "database error" not in r.err
    assert fingerprint(env) == before
    return r


def ids(env: TestEnv, sql: str, *params: str) -> set:
    return {row["id"] for row in env.conn.execute(sql, params).fetchall()}


@FUZZ
@given(reason=hostile)
@example(reason="deadline")  # the kinds the seeded env has dead steps of: never an empty answer
@example(reason="error")
def test_reason_is_one_of_the_error_kinds_or_a_usage_error(capsys, seeded, reason):
    env, before = seeded
    r = check(capsys, env, before, "dlq", "list", "--json", "--reason", reason)
    if reason in KINDS:
        assert r.code == 0
        dead = ids(env, "SELECT id FROM cyclone_steps WHERE state = 'dead' AND error_kind = %s",
                   reason)  # fmt: skip
        assert {x["id"] for x in r.json()} == dead
        assert dead or reason not in ("deadline", "error")  # what the seeded env holds
    else:
        assert r.code == 2 and r.out == ""


@FUZZ
@given(run_id=hostile)
def test_a_run_id_is_a_uuid_or_a_usage_error(capsys, seeded, run_id):
    env, before = seeded
    r = check(capsys, env, before, "steps", "--json", "--", run_id)
    assert r.code in (1, 2) and r.out == ""  # no real run has a fuzzed id


@FUZZ
@given(step_id=hostile)
def test_a_step_id_is_a_whole_number_or_a_usage_error(capsys, seeded, step_id):
    env, before = seeded
    # A real dead step's id is a valid request that would (rightly) change the shared env.
    dead = {row[1] for row in before if row[0] == "step" and row[2] == "dead"}
    assume(step_id.lstrip("0") not in dead)
    r = check(capsys, env, before, "dlq", "retry", "--", step_id)
    assert r.code in (1, 2)


@FUZZ
@given(workflow=hostile)
@example(workflow="cli-approve")  # the seeded env's workflows: never an empty answer
@example(workflow="cli-fragile")
def test_a_workflow_filter_matches_exactly_or_is_a_usage_error(capsys, seeded, workflow):
    env, before = seeded
    expected = {"runs": set(), "dlq": set()} if "\x00" in workflow else {
        "runs": ids(env, "SELECT id::text FROM cyclone_runs WHERE workflow = %s", workflow),
        "dlq": ids(env, "SELECT id FROM cyclone_steps WHERE state = 'dead' AND workflow = %s",
                   workflow),
    }  # fmt: skip
    if workflow in ("cli-approve", "cli-fragile"):
        assert expected["runs"] and expected["dlq"]
    for argv in (["runs"], ["dlq", "list"]):
        r = check(capsys, env, before, *argv, "--json", f"--workflow={workflow}")
        if r.code == 0:
            assert {x["id"] for x in r.json()} == expected[argv[0]]
        else:
            assert r.code == 2 and "\x00" in workflow


@FUZZ
@given(since=hostile)
def test_since_is_a_duration_or_a_usage_error(capsys, seeded, since):
    env, before = seeded
    r = check(capsys, env, before, "dlq", "list", "--json", f"--since={since}")
    try:
        seconds = parse_duration(since)
    except ValueError:
        assert r.code == 2
        return
    assert r.code == 0
    now = env.conn.execute("SELECT now() AS now").fetchone()["now"]
    rows = env.conn.execute(
        "SELECT id FROM cyclone_steps WHERE state = 'dead' AND completed_at >= %s",
        (now - timedelta(seconds=seconds) - timedelta(seconds=5),),
    ).fetchall()
    assert {x["id"] for x in r.json()} <= {row["id"] for row in rows}


@FUZZ
@given(limit=hostile)
def test_limit_is_bounded_or_a_usage_error(capsys, seeded, limit):
    env, before = seeded
    r = check(capsys, env, before, "runs", "--json", f"--limit={limit}")
    if r.code == 0:
        assert 1 <= int(limit) <= 10_000 and len(r.json()) <= int(limit)
    else:
        assert r.code == 2

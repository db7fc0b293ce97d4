"""The schema: migrations, constraints that mirror the Python enums, and index-backed queries."""

from __future__ import annotations

import json
import re
import threading
import uuid

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cyclone
from cyclone.db import connect
from cyclone.migrate import latest_version, migrate
from cyclone.sql import QUERIES, migrations
from cyclone.states import ErrorKind, NodeKind, RunState, StepState
from cyclone.testing import TestEnv


def _check_values(conn, table: str, column: str) -> set[str]:
    """The values the column's domain (text with a CHECK on its list) accepts."""
    rows = conn.execute(
        "SELECT pg_get_constraintdef(k.oid) AS def FROM pg_attribute a "
        "JOIN pg_constraint k ON k.contypid = a.atttypid "
        "WHERE a.attrelid = %s::regclass AND a.attname = %s AND k.contype = 'c'",
        (table, column),
    ).fetchall()
    assert len(rows) == 1, f"no CHECK on the type of {table}.{column}"
    assert re.match(r"CHECK \(+VALUE = ANY", rows[0]["def"]), rows[0]["def"]
    return set(re.findall(r"'([a-z_]+)'::text", rows[0]["def"]))


@pytest.mark.parametrize(
    ("table", "column", "enum"),
    [
        ("cyclone_runs", "state", RunState),
        ("cyclone_steps", "state", StepState),
        ("cyclone_steps", "error_kind", ErrorKind),
        ("cyclone_steps", "kind", NodeKind),
    ],
)
def test_python_enums_match_the_sql_checks(env: TestEnv, table, column, enum):
    assert _check_values(env.conn, table, column) == {e.value for e in enum}


@pytest.mark.parametrize("kind", list(NodeKind))
def test_what_a_kind_implies_is_said_alike_in_python_and_sql(env: TestEnv, kind: NodeKind):
    row = env.conn.execute("SELECT cyclone_kind_first_state(%s) AS state", (kind,)).fetchone()
    assert row["state"] == kind.first_state


@pytest.mark.parametrize("name", ["step_insert", "run_submit", "step_complete_chain"])
def test_the_kind_function_is_inlined_into_the_statements_that_make_steps(env: TestEnv, name):
    # Inlined, it costs what the CASE written out in place cost: no call per step inserted.
    assert "cyclone_kind_first_state" in QUERIES[name]
    text = re.sub(r"%\((\w+)\)s", "NULL", QUERIES[name])
    plan = env.conn.execute(f"EXPLAIN (VERBOSE, COSTS OFF) {text}").fetchall()  # type: ignore[arg-type]
    lines = "\n".join(r["QUERY PLAN"] for r in plan)
    assert "'waiting'::text" in lines and "cyclone_kind_first_state" not in lines


def test_migrating_twice_applies_nothing_the_second_time(env: TestEnv):
    assert migrate(env.conn) == []
    versions = [r["version"] for r in env.conn.execute("SELECT version FROM cyclone_migrations")]
    # Gaps in the numbering are fine (numbers are handed out ahead of parallel work).
    assert versions == [v for v, _, _ in migrations()]
    assert versions[-1] == latest_version()


@pytest.mark.parametrize("each_file", [False, True], ids=["from_schema_sql", "file_by_file"])
def test_concurrent_migrators_apply_each_migration_once(scratch_dsn: str, each_file: bool):
    results: list[list[int]] = []
    threads = [
        threading.Thread(target=lambda: results.append(migrate(scratch_dsn, each_file=each_file)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(len(r) for r in results) == [0, 0, 0, len(migrations())]
    with connect(scratch_dsn) as conn:
        recorded = conn.execute("SELECT version FROM cyclone_migrations ORDER BY version")
        assert [r["version"] for r in recorded] == [v for v, _, _ in migrations()]


def test_version_3_keeps_the_rows_of_a_version_2_database(scratch_dsn: str):
    wf = cyclone.Workflow("schema-v2")
    wf.wait("w")
    graph = wf.graph
    with connect(scratch_dsn) as conn:
        conn.execute(QUERIES["migration_table_create"])
        for version, name, sql in migrations()[:2]:
            conn.execute(sql.encode())
            conn.execute(QUERIES["migration_record"], {"version": version, "name": name})
        # A run and its parked step as version 2's code wrote them (today's statements read
        # tables of later versions).
        run_id = str(uuid.uuid4())
        conn.execute(
            "INSERT INTO cyclone_graphs (hash, workflow, graph) VALUES (%s, %s, %s)",
            (graph.hash, wf.name, json.dumps(graph.to_json())),
        )
        conn.execute(
            "INSERT INTO cyclone_workflows (name, graph_hash) VALUES (%s, %s)",
            (wf.name, graph.hash),
        )
        conn.execute(
            "INSERT INTO cyclone_runs (id, workflow, graph_hash, state, input, created_at) "
            "VALUES (%s, %s, %s, 'running', '{\"kept\": true}', now())",
            (run_id, wf.name, graph.hash),
        )
        conn.execute(
            "INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, max_attempts, "
            "signal, available_at, created_at) "
            "VALUES (%s, %s, 'w', 'wait', 'waiting', 1, 'w', now(), now())",
            (run_id, wf.name),
        )
        with cyclone.Client(scratch_dsn) as client:
            assert migrate(conn) == [v for v, _, _ in migrations() if v >= 3]
            assert client.get_run(run_id).state == RunState.RUNNING
            assert client.get_run(run_id).input == {"kept": True}
            assert [s.state for s in client.steps(run_id)] == [StepState.WAITING]
        with pytest.raises(psycopg.errors.CheckViolation) as caught:
            conn.execute("UPDATE cyclone_steps SET state = 'running'")
        assert caught.value.diag.constraint_name == "cyclone_steps_rules"  # migration 5's


def test_a_running_step_must_hold_a_lease_token(env: TestEnv):
    wf = cyclone.Workflow("schema-lease")
    wf.wait("w")
    env.client.submit(wf, {})
    with pytest.raises(psycopg.errors.CheckViolation):
        env.conn.execute("UPDATE cyclone_steps SET state = 'running'")
    with pytest.raises(psycopg.errors.CheckViolation):
        env.conn.execute("UPDATE cyclone_steps SET state = 'completed'")


# Each rule of the rule triggers (migration 5) and the domains (migration 3), broken one at a
# time on a valid row.
STEP_BREAKS = [
    "state = 'running'",  # running without a lease
    "lease_token = gen_random_uuid()",  # a lease on a step that is not running
    "state = 'running', lease_token = gen_random_uuid()",  # running without a lease expiry
    "lease_expires_at = now()",  # a lease expiry on a step that is not running
    "state = 'completed'",  # ended without completed_at
    "completed_at = now()",  # completed_at on a step that has not ended
    "state = 'dead', completed_at = now()",  # dead without saying why
    "output = '1'",  # output on a step that has not completed
    "attempt = -1",
    "max_attempts = 0",
    "item_index = -1",
    "state = 'finished'",  # not a step state
    "kind = 'cron'",  # not a node kind
    "error_kind = 'oops'",  # not an error kind
]
RUN_BREAKS = [
    "state = 'completed'",  # ended without finished_at
    "finished_at = now()",  # finished_at on a running run
    "state = 'paused'",  # paused without paused_at
    "paused_at = now()",  # paused_at on a running run
    "output = '1'",  # output on a run that has not completed
    "parent_run_id = id, deadline_at = now()",  # a child run with a deadline of its own
    "state = 'done'",  # not a run state
]


@pytest.mark.parametrize(
    ("table", "change"),
    [("cyclone_steps", c) for c in STEP_BREAKS] + [("cyclone_runs", c) for c in RUN_BREAKS],
)
def test_each_rule_rejects_a_row_that_breaks_it(env: TestEnv, table: str, change: str):
    wf = cyclone.Workflow("schema-rules")
    wf.wait("w")
    run_id = env.client.submit(wf, {})
    with pytest.raises(psycopg.errors.CheckViolation):
        env.conn.execute(f"UPDATE {table} SET {change}")
    assert env.client.get_run(run_id).state == RunState.RUNNING
    (step,) = env.client.steps(run_id)
    assert step.state == StepState.WAITING and step.attempt == 0


@pytest.mark.parametrize(
    ("table", "change", "rule"),
    [
        ("cyclone_steps", "state = 'running'", "lease_token is set exactly while"),
        ("cyclone_steps", "output = '1'", "only a completed step has output"),
        ("cyclone_runs", "paused_at = now()", "paused_at is set exactly while"),
    ],
)
def test_a_broken_rule_names_its_constraint_and_the_rule(env: TestEnv, table, change, rule):
    wf = cyclone.Workflow("schema-rule-detail")
    wf.wait("w")
    env.client.submit(wf, {})
    with pytest.raises(psycopg.errors.CheckViolation) as caught:
        env.conn.execute(f"UPDATE {table} SET {change}")
    diag = caught.value.diag
    assert (diag.constraint_name, diag.table_name) == (f"{table}_rules", table)
    assert rule in (diag.message_detail or "")


# The rules as the trigger functions (migration 6) must read: for each, the text that names
# it and when a row breaks it. None stands for NULL; a rule on a NULL is not broken.
STEP_RULES = [
    ("lease_token is set exactly while the step is running",
     lambda r: (r["lease_token"] is not None) != (r["state"] == "running")),
    ("lease_expires_at is set exactly while the step is running",
     lambda r: (r["lease_expires_at"] is not None) != (r["state"] == "running")),
    ("completed_at is set exactly once the step ended",
     lambda r: (r["completed_at"] is not None)
     != (r["state"] in ("completed", "dead", "discarded"))),
    ("a dead step has an error_kind",
     lambda r: r["error_kind"] is None and r["state"] == "dead"),
    ("only a completed step has output",
     lambda r: r["output"] is not None and r["state"] != "completed"),
    ("attempt >= 0 and max_attempts >= 1",
     lambda r: not (r["attempt"] >= 0 and r["max_attempts"] >= 1)),
    ("item_index >= 0", lambda r: r["item_index"] is not None and r["item_index"] < 0),
]  # fmt: skip
RUN_RULES = [
    ("finished_at is set exactly once the run ended",
     lambda r: (r["finished_at"] is not None)
     != (r["state"] in ("completed", "failed", "cancelled"))),
    ("paused_at is set exactly while the run is paused",
     lambda r: (r["paused_at"] is not None) != (r["state"] == "paused")),
    ("only a completed run has output",
     lambda r: r["output"] is not None and r["state"] != "completed"),
    ("a child run has no deadline of its own",
     lambda r: r["parent_run_id"] is not None and r["deadline_at"] is not None),
]  # fmt: skip
NOW = "2026-01-01T00:00:00Z"
UUID = "00000000-0000-4000-8000-000000000001"
OWN_ID = "<the run's own id>"  # parent_run_id must name a run that exists
# Rows that keep every rule, one per state; the examples change up to three columns of one.
VALID_STEPS = {
    "available": {}, "waiting": {}, "running": {"lease_token": UUID, "lease_expires_at": NOW},
    "completed": {"completed_at": NOW, "output": "1"},
    "dead": {"completed_at": NOW, "error_kind": "error"},
    "discarded": {"completed_at": NOW, "error_kind": "cancelled"},
}  # fmt: skip
STEP_OTHER = {"lease_token": UUID, "lease_expires_at": NOW, "completed_at": NOW,
              "error_kind": "error", "output": "1"}  # fmt: skip
VALID_RUNS = {
    "running": {}, "paused": {"paused_at": NOW}, "completed": {"finished_at": NOW, "output": "1"},
    "failed": {"finished_at": NOW}, "cancelled": {"finished_at": NOW},
}  # fmt: skip
RUN_OTHER = {"finished_at": NOW, "paused_at": NOW, "output": "1", "parent_run_id": OWN_ID,
             "deadline_at": NOW}  # fmt: skip
NUMBERS = {"attempt": (0, -1), "max_attempts": (1, 0), "item_index": (None, -1)}


@st.composite
def rule_rows(draw, valid: dict, other: dict, numbers: dict) -> dict:
    """A row of `valid` (by state) with up to three columns changed: one of `other` to its
    other value (set where it was NULL, NULL where it was set), one of `numbers` to its
    broken value."""
    state = draw(st.sampled_from(sorted(valid)))
    flips = draw(st.sets(st.sampled_from(sorted([*other, *numbers])), max_size=3))
    row = {"state": state}
    for column, value in other.items():
        kept = valid[state].get(column)
        row[column] = (value if kept is None else None) if column in flips else kept
    for column, (kept, broken) in numbers.items():
        row[column] = broken if column in flips else kept
    return row


def _rules_hold_as_modelled(env: TestEnv, table: str, rules, row: dict) -> None:
    broken = [text for text, breaks in rules if breaks(row)]
    sets = ", ".join(
        f"{column} = id" if value == OWN_ID else f"{column} = %({column})s"
        for column, value in row.items()
    )
    # Every example writes the env's one run and its step, and rolls the write back.
    if not env.conn.execute("SELECT 1 FROM cyclone_runs").fetchone():
        env.client.submit(RULES_WF, {})
    try:
        with env.conn.transaction(force_rollback=True):
            env.conn.execute(f"UPDATE {table} SET {sets}", row)
    except psycopg.errors.CheckViolation as exc:
        assert exc.diag.constraint_name == f"{table}_rules", exc
        assert exc.diag.message_detail == "; ".join(broken), row
    else:
        assert broken == [], f"{row} breaks {broken} but was accepted"


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(row=rule_rows(VALID_STEPS, STEP_OTHER, NUMBERS))
def test_the_step_rules_accept_and_name_exactly_what_the_model_says(env: TestEnv, row):
    _rules_hold_as_modelled(env, "cyclone_steps", STEP_RULES, row)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(row=rule_rows(VALID_RUNS, RUN_OTHER, {}))
def test_the_run_rules_accept_and_name_exactly_what_the_model_says(env: TestEnv, row):
    _rules_hold_as_modelled(env, "cyclone_runs", RUN_RULES, row)


RULES_WF = cyclone.Workflow("schema-rules-model")
RULES_WF.wait("w")


@pytest.mark.parametrize(
    ("table", "column"),
    [
        ("cyclone_steps", "state"),
        ("cyclone_steps", "attempt"),
        ("cyclone_steps", "max_attempts"),
        ("cyclone_runs", "state"),
    ],
)
def test_a_null_in_a_not_null_column_is_named_by_not_null_not_by_the_rules(
    env: TestEnv, table: str, column: str
):
    wf = cyclone.Workflow("schema-rule-null")
    wf.wait("w")
    env.client.submit(wf, {})
    with pytest.raises(psycopg.errors.NotNullViolation) as caught:
        env.conn.execute(f"UPDATE {table} SET {column} = NULL")
    assert caught.value.diag.column_name == column


def test_the_rules_are_triggers_and_no_check_constraint_is_left(env: TestEnv):
    checks = env.conn.execute(
        "SELECT conname FROM pg_constraint WHERE contype = 'c'"
        " AND conrelid IN ('cyclone_steps'::regclass, 'cyclone_runs'::regclass)"
    ).fetchall()
    triggers = env.conn.execute(
        "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal"
        " AND tgrelid IN ('cyclone_steps'::regclass, 'cyclone_runs'::regclass) ORDER BY 1"
    ).fetchall()
    assert checks == []
    # slot_freed, held: v14 (with a WHEN of one column since v23, when the others' conditions
    # moved into the rules' functions: a WHEN clause is compiled for every statement); the
    # steps' slot_freed went in v33, when the rules' function took over a node slot's claim
    # and release
    names = ["cyclone_runs_rules", "cyclone_runs_slot_freed", "cyclone_steps_held",
             "cyclone_steps_rules"]  # fmt: skip
    assert [t["tgname"] for t in triggers] == names


def test_no_trigger_of_the_hot_tables_has_a_when_clause_of_more_than_one_column(env: TestEnv):
    """A WHEN clause is read back from text and compiled by every statement that may fire it:
    nine of them cost a completed step a third of its server instructions (migration 23)."""
    rows = env.conn.execute(
        "SELECT tgname, pg_get_triggerdef(oid) AS def FROM pg_trigger WHERE NOT tgisinternal"
        " AND tgrelid IN ('cyclone_steps'::regclass, 'cyclone_runs'::regclass) ORDER BY 1"
    ).fetchall()
    whens = {r["tgname"]: r["def"].partition(" WHEN ")[2].partition(" EXECUTE ")[0] for r in rows}
    assert whens == {
        "cyclone_runs_rules": "",
        "cyclone_runs_slot_freed": "((new.concurrency_limit IS NOT NULL))",
        "cyclone_steps_held": "(new.held)",
        "cyclone_steps_rules": "",
    }


def test_rows_that_keep_every_rule_are_accepted(env: TestEnv):
    wf = cyclone.Workflow("schema-rules-ok")
    wf.wait("w")
    run_id = env.client.submit(wf, {})
    env.conn.execute(
        "UPDATE cyclone_steps SET state = 'dead', completed_at = now(), error_kind = 'max_wait'"
    )
    env.conn.execute("UPDATE cyclone_runs SET state = 'paused', paused_at = now()")
    env.conn.execute(
        "UPDATE cyclone_runs SET state = 'failed', paused_at = NULL, finished_at = now()"
    )
    assert env.client.get_run(run_id).state == RunState.FAILED


def test_migration_4_drops_the_child_run_index_and_keeps_the_rest(env: TestEnv):
    names = {r["indexname"] for r in env.conn.execute(
        "SELECT indexname FROM pg_indexes"
        " WHERE schemaname = current_schema() AND tablename = 'cyclone_steps'"
    )}  # fmt: skip
    assert "cyclone_steps_child_idx" not in names  # dropped by migration 4
    assert "cyclone_steps_node_idx" in names and "cyclone_steps_available_idx" in names


def test_connect_gives_autocommit_dict_rows(env: TestEnv):
    with connect(env.dsn) as conn:
        assert conn.autocommit
        assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}

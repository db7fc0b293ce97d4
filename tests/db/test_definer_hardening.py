"""SECURITY DEFINER functions cannot be turned against their owner, and the runtime role cannot
erase history through retention (migration 15).

Under the real roles of a deployment: a migrating role that owns the schema, a runtime role
given the printed GRANTs. Both log in to the test server; nothing here starts a process.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import cyclone
from cyclone.clients.client import Client
from cyclone.migrate import migrate
from cyclone.sql import QUERIES
from cyclone.testing import TestEnv

DEFINER_WF = cyclone.Workflow("definer-hardening")
DEFINER_WF.wait("w")


@dataclass
class Roles:
    schema: str
    migrator: str
    runtime: str
    base: str

    def dsn(self, role: str) -> str:
        return make_conninfo(self.base, user=role, options=f"-c search_path={self.schema}")


@pytest.fixture
def roles(pg_dsn: str) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:8]
    r = Roles(f"cyclone_definer_{tag}", f"mig_{tag}", f"run_{tag}", pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        for role in (r.migrator, r.runtime):
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(
            sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                sql.Identifier(r.schema), sql.Identifier(r.migrator)
            )
        )
    try:
        with psycopg.connect(r.dsn(r.migrator), autocommit=True) as conn:
            migrate(conn)
            grants = sql.SQL(QUERIES["grants_print"]).format(
                schema=sql.Identifier(r.schema),
                migrator=sql.Identifier(r.migrator),
                runtime=sql.Identifier(r.runtime),
                readonly=sql.Identifier(r.migrator),
            )
            conn.execute(grants.as_string(conn).encode())
        yield r
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(r.schema)))
            for role in (r.migrator, r.runtime):
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_every_security_definer_function_searches_its_schema_then_pg_temp_only(env: TestEnv):
    rows = env.conn.execute(
        "SELECT p.proname, p.proconfig, p.prosrc FROM pg_proc p"
        " WHERE p.pronamespace = current_schema()::regnamespace AND p.prosecdef"
        " ORDER BY p.proname"
    ).fetchall()
    assert [r["proname"] for r in rows] == [  # a new one: check it
        "cyclone_delete_finished",
        "cyclone_history_drop",
        "cyclone_history_ensure",
        "cyclone_history_move",
    ]
    # Settings that change how the body is planned or waits, nothing it resolves names by.
    harmless = {"enable_hashjoin=off", "enable_mergejoin=off", "lock_timeout=100ms"}
    for row in rows:
        # pg_temp listed, and last: not listed, it is searched first for relations.
        assert row["proconfig"][0] == f"search_path={env.schema}, pg_temp", row["proname"]
        assert set(row["proconfig"][1:]) <= harmless, row["proname"]
        # Every table the body names carries the schema, so no search happens at all.
        body = row["prosrc"].replace(f"{env.schema}.", "<schema>.")
        body = body.replace(f"'{env.schema}'", "'<schema>'")  # DDL's format() argument
        unqualified = re.findall(r"(?<![\w.])cyclone_\w+", body)
        assert "<schema>.cyclone_" in body, row["proname"]
        assert unqualified == [], (row["proname"], unqualified)


# The attack of issue 22, as the runtime role: a temporary view shadowing cyclone_runs calls a
# temporary function, which grants the runtime role what it may not have if it runs as the
# function's owner. The INSTEAD OF trigger lets the function's DELETE through the view succeed,
# so nothing rolls the grants back.
ATTACK = """
CREATE FUNCTION pg_temp.escalate() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    RAISE NOTICE 'escalate ran as %', current_user;
    EXECUTE format('GRANT DELETE, TRUNCATE ON %I.cyclone_runs TO %I', '{schema}', '{runtime}');
    EXECUTE format('GRANT CREATE ON SCHEMA %I TO %I', '{schema}', '{runtime}');
    RETURN false;
END $$;
CREATE FUNCTION pg_temp.nothing() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RETURN NULL; END $$;
CREATE TEMP VIEW cyclone_runs AS
    SELECT id, finished_at, parent_run_id FROM {schema}.cyclone_runs
    UNION ALL SELECT NULL::uuid, NULL::timestamptz, NULL::uuid WHERE pg_temp.escalate();
CREATE TRIGGER nothing INSTEAD OF DELETE ON pg_temp.cyclone_runs
    FOR EACH ROW EXECUTE FUNCTION pg_temp.nothing();
GRANT ALL ON pg_temp.cyclone_runs TO PUBLIC;
"""


def test_a_temporary_view_of_the_runtime_role_runs_nothing_as_the_owner(roles: Roles):
    notices: list[str] = []
    with psycopg.connect(roles.dsn(roles.runtime), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute(ATTACK.format(schema=roles.schema, runtime=roles.runtime).encode())
        deleted = conn.execute("SELECT cyclone_delete_finished(0, 10, 'infinity')").fetchone()
        assert deleted == (0,)
        gained = conn.execute(
            "SELECT has_table_privilege(%(t)s, 'DELETE'), has_table_privilege(%(t)s, 'TRUNCATE'),"
            " has_schema_privilege(%(s)s, 'CREATE')",
            {"t": f"{roles.schema}.cyclone_runs", "s": roles.schema},
        ).fetchone()
    assert notices == [] and gained == (False, False, False), (notices, gained)


def _finished_runs(roles: Roles, n: int) -> list[str]:
    with Client(roles.dsn(roles.runtime)) as client:
        run_ids = [client.submit(DEFINER_WF, {"n": i}) for i in range(n)]
        for run_id in run_ids:
            assert client.cancel(run_id)
    return run_ids


def _count_runs(roles: Roles) -> int:
    with psycopg.connect(roles.dsn(roles.migrator)) as conn:
        return conn.execute("SELECT count(*) FROM cyclone_runs").fetchone()[0]


def test_the_runtime_role_cannot_erase_a_day_of_history_and_the_owner_still_can(roles: Roles):
    _finished_runs(roles, 3)
    with psycopg.connect(roles.dsn(roles.migrator), autocommit=True) as owner:
        # One run finished two days ago (the owner may say so): past any floor.
        owner.execute(
            "UPDATE cyclone_runs SET finished_at = finished_at - interval '2 days'"
            " WHERE id = (SELECT id FROM cyclone_runs ORDER BY id LIMIT 1)"
        )
    with psycopg.connect(roles.dsn(roles.runtime), autocommit=True) as runtime:
        for at in ("infinity", "3000-01-01", None):
            done = runtime.execute("SELECT cyclone_delete_finished(0, 100, %s)", (at,))
            assert done.fetchone() == (1 if at == "infinity" else 0,), at
    assert _count_runs(roles) == 2  # the old one went; the day's runs stay
    with psycopg.connect(roles.dsn(roles.migrator), autocommit=True) as owner:
        later = owner.execute("SELECT now() + interval '1 second'").fetchone()[0]
        assert owner.execute("SELECT cyclone_delete_finished(0, 100, %s)", (later,)).fetchone() == (
            2,
        )


def test_the_runtime_role_ends_runs_now_but_never_in_the_past_nor_rewrites_them(roles: Roles):
    with Client(roles.dsn(roles.runtime)) as client:
        run_id = client.submit(DEFINER_WF, {})
    with psycopg.connect(roles.dsn(roles.runtime), autocommit=True) as runtime:
        for change, params in (
            ("state = 'completed', finished_at = now() - interval '30 days'", None),
            ("state = 'completed', finished_at = now() - %s", (timedelta(seconds=1),)),
            ("created_at = created_at - interval '30 days'", None),
            ("input = '{}'", None),
            ("parent_run_id = NULL", None),
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                runtime.execute(f"UPDATE cyclone_runs SET {change}", params)  # type: ignore[arg-type]
        runtime.execute("UPDATE cyclone_runs SET state = 'cancelled', finished_at = now()")
    with Client(roles.dsn(roles.runtime)) as client:
        assert client.get_run(run_id).state == "cancelled"

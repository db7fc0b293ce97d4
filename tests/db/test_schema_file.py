"""cyclone/sql/schema.sql is the schema a migrated database has, object by object, row by row.

`migrate` makes a schema never migrated from that file (as every TestEnv is made), so the
comparison is between the two ways `migrate` has: the migration files one by one
(`each_file=True`, as an older database is brought up to date) and schema.sql in one go.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from cyclone.migrate import migrate
from cyclone.sql import QUERIES, current_schema, migrations
from cyclone.testing_schemas import SchemaKeeper

# Each query lists one kind of object of the schema %(schema)s as (key, definition) rows. The
# definitions are PostgreSQL's own rendering, so two schemas made by different statements
# compare equal exactly when they hold the same objects.
_CATALOG = {
    "relation": """
        SELECT c.relname, c.relkind::text || ' ' || c.relpersistence::text
               || ' rls=' || c.relrowsecurity || ' options=' || coalesce(c.reloptions::text, '')
               || ' acl=' || coalesce(c.relacl::text, '')
          FROM pg_class c WHERE c.relnamespace = %(schema)s::regnamespace""",
    # In order: a column added by a later migration sits last in the table, as it must here.
    "columns": """
        SELECT c.relname, string_agg(
                   format('%%s %%s%%s%%s%%s%%s', a.attname, format_type(a.atttypid, a.atttypmod),
                          CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END,
                          ' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid),
                          CASE WHEN a.attidentity <> ''
                               THEN ' IDENTITY ' || a.attidentity::text END,
                          CASE WHEN a.attgenerated <> '' THEN ' GENERATED' END),
                   ', ' ORDER BY a.attnum)
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE c.relnamespace = %(schema)s::regnamespace AND c.relkind IN ('r', 'v', 'p')
           AND a.attnum > 0 AND NOT a.attisdropped
         GROUP BY c.relname""",
    "constraint": """
        SELECT coalesce(c.relname, t.typname) || '.' || k.conname,
               k.contype::text || ' ' || pg_get_constraintdef(k.oid)
          FROM pg_constraint k
          LEFT JOIN pg_class c ON c.oid = k.conrelid
          LEFT JOIN pg_type t ON t.oid = k.contypid
         WHERE k.connamespace = %(schema)s::regnamespace""",
    "index": """
        SELECT i.relname, pg_get_indexdef(i.oid)
          FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
         WHERE i.relnamespace = %(schema)s::regnamespace""",
    "type": """
        SELECT t.typname, t.typtype::text || ' ' || format_type(t.typbasetype, t.typtypmod)
               || CASE WHEN t.typnotnull THEN ' NOT NULL' ELSE '' END
               || coalesce(' DEFAULT ' || t.typdefault, '')
          FROM pg_type t
         WHERE t.typnamespace = %(schema)s::regnamespace AND t.typtype IN ('d', 'e')""",
    "function": """
        SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
               pg_get_functiondef(p.oid) || ' acl=' || coalesce(p.proacl::text, '')
          FROM pg_proc p WHERE p.pronamespace = %(schema)s::regnamespace""",
    "trigger": """
        SELECT c.relname || '.' || g.tgname, pg_get_triggerdef(g.oid) || ' ' || g.tgenabled::text
          FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid
         WHERE c.relnamespace = %(schema)s::regnamespace AND NOT g.tgisinternal""",
    "view": """
        SELECT c.relname, pg_get_viewdef(c.oid)
          FROM pg_class c WHERE c.relnamespace = %(schema)s::regnamespace AND c.relkind = 'v'""",
    "sequence": """
        SELECT c.relname, format('%%s start %%s step %%s min %%s max %%s cycle %%s',
                                 format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement,
                                 s.seqmin, s.seqmax, s.seqcycle)
          FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
         WHERE c.relnamespace = %(schema)s::regnamespace""",
    # Where a sequence stands: a migration's setval (the wake counters) is data, not DDL.
    "sequence_value": """
        SELECT sequencename, coalesce(last_value::text, 'not called')
          FROM pg_sequences WHERE schemaname = %(schema)s""",
    "partitioning": """
        SELECT c.relname, coalesce(pg_get_partkeydef(c.oid), '')
               || coalesce(' of ' || p.relname || ' ' || pg_get_expr(c.relpartbound, c.oid), '')
          FROM pg_class c
          LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
          LEFT JOIN pg_class p ON p.oid = i.inhparent
         WHERE c.relnamespace = %(schema)s::regnamespace
           AND (c.relkind = 'p' OR c.relispartition)""",
    # The tables whose rows are compared ("rows" below), with the columns whose default is
    # now(): their values are the moment of the migration, compared only for being there.
    "rows": """
        SELECT c.relname, coalesce(string_agg(a.attname, ' ') FILTER (
                   WHERE pg_get_expr(d.adbin, d.adrelid) = 'now()'), '')
          FROM pg_class c
          JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE c.relnamespace = %(schema)s::regnamespace AND c.relkind IN ('r', 'p')
         GROUP BY c.relname""",
}


def catalog(conn: psycopg.Connection, schema: str) -> dict[str, str]:
    """Every object of the schema, as 'kind name' -> definition, the schema's name left out;
    for a table, 'rows name' -> its rows (a seed row a migration inserts is part of it)."""
    out: dict[str, str] = {}
    for kind, query in _CATALOG.items():
        for key, definition in conn.execute(query, {"schema": schema}).fetchall():  # type: ignore[arg-type]
            if kind == "rows":
                definition = _rows(conn, schema, key, definition.split())
            out[f"{kind} {key}"] = definition.replace(schema, "<schema>")
    return out


def _rows(conn: psycopg.Connection, schema: str, table: str, at_migration: list[str]) -> str:
    query = sql.SQL("SELECT to_jsonb(t) FROM {}.{} t").format(
        sql.Identifier(schema), sql.Identifier(table)
    )
    rows = []
    for (row,) in conn.execute(query).fetchall():
        for column in at_migration:
            row[column] = row[column] is not None
        rows.append(json.dumps(row, sort_keys=True))
    return "\n".join(sorted(rows))


@pytest.fixture
def schemas(pg_dsn: str) -> Iterator[tuple[psycopg.Connection, list[str]]]:
    made: list[str] = []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        try:
            yield conn, made
        finally:
            for name in made:
                conn.execute(sql.SQL(QUERIES["schema_drop"]).format(sql.Identifier(name)))


def _new_schema(conn: psycopg.Connection, made: list[str]) -> str:
    name = f"cyclone_schema_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL(QUERIES["schema_create"]).format(sql.Identifier(name)))
    made.append(name)
    conn.execute("SELECT set_config('search_path', %s, false)", (name,))
    return name


def _from_file(conn: psycopg.Connection, made: list[str]) -> str:
    """A schema made as `migrate` makes a new one: from schema.sql, in one go."""
    name = _new_schema(conn, made)
    assert migrate(conn) == [version for version, _, _ in migrations()]
    return name


def _migrated(conn: psycopg.Connection, made: list[str]) -> str:
    """A schema made by the migration files, one by one."""
    name = _new_schema(conn, made)
    applied: list[int] = []
    # Run and recorded one by one: a file's own statements, not schema.sql's, made the schema.
    execute = conn.execute

    def recording(query, *args, **kwargs):  # type: ignore[no-untyped-def]
        if query == QUERIES["migration_record"]:
            applied.append(args[0]["version"])
        assert not (isinstance(query, bytes) and query == current_schema().encode())
        return execute(query, *args, **kwargs)

    conn.execute = recording  # type: ignore[method-assign]
    try:
        assert migrate(conn, each_file=True) == applied == [v for v, _, _ in migrations()]
    finally:
        del conn.execute
    return name


def _differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [
        f"{key}:\n  migrated:    {a.get(key)}\n  schema.sql:  {b.get(key)}"
        for key in sorted(a.keys() | b.keys())
        if a.get(key) != b.get(key)
    ]


def test_a_freshly_migrated_database_matches_schema_sql_exactly(schemas):
    conn, made = schemas
    migrated = catalog(conn, _migrated(conn, made))
    from_file = catalog(conn, _from_file(conn, made))
    # The check has something to compare: every kind of object is there.
    assert {key.split()[0] for key in migrated} == set(_CATALOG)
    differences = _differences(migrated, from_file)
    assert not differences, (
        "cyclone/sql/schema.sql no longer matches the migrations; write the change there too:\n"
        + "\n".join(differences)
    )


def test_a_schema_made_ahead_for_a_testenv_matches_one_migrate_makes(schemas, pg_dsn):
    conn, made = schemas
    keeper = SchemaKeeper(pg_dsn)
    try:
        keeper.take()
        deadline = time.monotonic() + 10
        while (ahead := keeper.take()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        assert keeper.settle() == []
    assert ahead is not None
    made.append(ahead)
    from_file = catalog(conn, _from_file(conn, made))
    # On the search_path, as each schema is when its catalog is read (or its types would be
    # written qualified with its name).
    conn.execute("SELECT set_config('search_path', %s, false)", (ahead,))
    differences = _differences(from_file, catalog(conn, ahead))
    assert not differences, "\n".join(differences)


@pytest.mark.parametrize(
    "change",
    [
        "ALTER TABLE cyclone_steps ADD COLUMN extra text",
        "ALTER TABLE cyclone_runs ALTER COLUMN waited SET DEFAULT true",
        "ALTER TABLE cyclone_workers ALTER COLUMN node SET NOT NULL",
        "DROP INDEX cyclone_steps_dead_idx",
        "CREATE OR REPLACE FUNCTION cyclone_oldest_due(at timestamptz) RETURNS timestamptz"
        " LANGUAGE sql STABLE AS $$ SELECT at $$",
        "ALTER TABLE cyclone_runs DISABLE TRIGGER cyclone_runs_slot_freed",
        "DO $$ BEGIN EXECUTE 'CREATE OR REPLACE VIEW cyclone_v_runs AS '"
        " || rtrim(pg_get_viewdef('cyclone_v_runs'), ';') || ' LIMIT 10'; END $$",
        "ALTER DOMAIN cyclone_node_kind ADD CHECK (VALUE <> 'map')",
        "GRANT EXECUTE ON FUNCTION cyclone_delete_finished(float8, integer, timestamptz) TO PUBLIC",
        # What a migration writes besides DDL: seed rows, sequence values, the bookkeeping.
        "DELETE FROM cyclone_queues",
        "UPDATE cyclone_history_mark SET moved_to = 'epoch'",
        "SELECT setval('cyclone_wake_timer', 1, true)",
        "UPDATE cyclone_migrations SET name = 'other' WHERE version = 1",
    ],
)
def test_the_comparison_notices_a_schema_change_missing_from_the_file(schemas, change):
    conn, made = schemas
    before = catalog(conn, _from_file(conn, made))
    changed = _from_file(conn, made)
    conn.execute(change)
    assert _differences(before, catalog(conn, changed))


def _documented_columns(view: str) -> list[str]:
    """The column names in the first cell of each row of docs/sql.md's table for `view`."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "sql.md").read_text()
    section = page.split(f"## `{view}`", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])]


@pytest.mark.parametrize("view", ["cyclone_v_runs", "cyclone_v_steps"])
def test_docs_sql_md_describes_every_column_of_the_views_in_order(env, view):
    columns = [
        r["attname"]
        for r in env.conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
            " ORDER BY attnum",
            (view,),
        )
    ]
    assert _documented_columns(view) == columns

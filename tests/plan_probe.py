"""EXPLAIN (ANALYZE, BUFFERS) of a named statement, as a prepared statement would run it.

A statement that psycopg has run often enough is prepared, and PostgreSQL may then run it
with a custom plan (made for these parameters) or the generic one (made once for any). Both
are checked, each in a transaction that is rolled back, so a write explained changes nothing.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from cyclone.sql import QUERIES, numbered

_COUNTER = itertools.count()


@dataclass(frozen=True)
class Probe:
    """What one execution touched: buffers, and the plan's nodes."""

    buffers: int
    nodes: list[dict[str, Any]]
    text: str

    def sorted_rows(self) -> int:
        """The most rows any Sort node took in."""
        return max(
            (n.get("Actual Rows", 0) * n.get("Actual Loops", 1) for n in self.nodes
             if n["Node Type"] in ("Sort", "Incremental Sort")),
            default=0,
        )  # fmt: skip

    def scanned_rows(self, relation: str | None = None) -> int:
        """The most rows any scan node read (of `relation`, if given): those it returned and
        those its filter dropped, over all its loops. Buffers alone miss a scan of a small,
        dense index: 20,000 entries are 21 pages."""
        return max(
            ((n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0)
              + n.get("Rows Removed by Index Recheck", 0)) * n.get("Actual Loops", 1)
             for n in self.nodes if n["Node Type"].endswith("Scan")
             and n["Node Type"] not in ("CTE Scan", "Function Scan", "Subquery Scan",
                                        "WorkTable Scan", "Values Scan")
             and relation in (None, n.get("Relation Name"))),
            default=0,
        )  # fmt: skip

    def scans(self) -> set[str]:
        return {f"{n['Node Type']}:{n.get('Relation Name', '')}" for n in self.nodes}


def _walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("Plans", ()):
        out.extend(_walk(child))
    return out


def probe(conn: Any, name: str, params: dict[str, Any], mode: str) -> Probe:
    """Explain QUERIES[name] prepared, with plan_cache_mode `mode` (custom or generic)."""
    return probe_text(conn, QUERIES[name], params, mode)


def probe_text(conn: Any, query: str, params: dict[str, Any], mode: str) -> Probe:
    """The same for a statement's text, with %(name)s placeholders. The mode applies to the
    statements of the PL/pgSQL functions it calls too: their plans follow plan_cache_mode."""
    text, names = numbered(query)
    args = sql.SQL(", ").join(sql.Literal(params[n]) for n in names)
    statement = sql.Identifier(f"plan_probe_{next(_COUNTER)}")
    call = (
        sql.SQL("EXECUTE {} ({})").format(statement, args)
        if names
        else sql.SQL("EXECUTE {}").format(statement)
    )
    with conn.transaction(force_rollback=True):
        conn.execute(f"SET LOCAL plan_cache_mode = force_{mode}_plan")
        conn.execute(sql.SQL("PREPARE {} AS {}").format(statement, sql.SQL(text)))  # type: ignore[arg-type]
        row = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {}").format(call)
        ).fetchone()
        conn.execute(sql.SQL("DEALLOCATE {}").format(statement))
    return _probe(row)


def _probe(row: Any) -> Probe:
    doc = next(iter(row.values())) if isinstance(row, dict) else row[0]
    if isinstance(doc, str):
        doc = json.loads(doc)
    plan = doc[0]["Plan"]
    buffers = plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
    return Probe(buffers, _walk(plan), json.dumps(plan, indent=1))


def probe_prepared(conn: Any, statement: str, args: list[Any]) -> Probe:
    """Explain a statement psycopg prepared on this connection (found by its text)."""
    found = conn.execute(
        "SELECT name FROM pg_prepared_statements WHERE statement = %s", (statement,)
    ).fetchone()
    assert found is not None, "psycopg did not prepare the statement"
    name = next(iter(found.values())) if isinstance(found, dict) else found[0]
    return probe_named(conn, name, args)


def execute_named(name: str, args: list[Any]) -> sql.Composed:
    """EXECUTE of the prepared statement `name` with these arguments, as literals."""
    values = sql.SQL(", ").join(sql.Literal(a) for a in args)
    return sql.SQL("EXECUTE {} ({})" if args else "EXECUTE {}").format(sql.Identifier(name), values)


def probe_named(conn: Any, name: str, args: list[Any]) -> Probe:
    """Explain the statement prepared on this connection as `name`, with the plan it keeps."""
    with conn.transaction(force_rollback=True):
        row = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) {}").format(
                execute_named(name, args)
            )
        ).fetchone()
    return _probe(row)

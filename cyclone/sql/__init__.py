"""Every SQL statement Cyclone runs, loaded once from the named blocks in this folder.

A block starts with `-- name: entity_verb` and runs to the next such line. Runtime code refers
to statements by name only (`QUERIES["step_lease"]`), so the SQL can be read, reviewed and
explained in one place. A block whose name starts with `_` is a fragment, not a statement: a
line `-- include: _name` in another block is replaced by it, so shared SQL is written once.

Two files here are not named blocks: `schema.sql`, the current schema written out (for
readers, and run by `migrate` to make a schema never migrated; a test holds it equal to what
the migrations make), and the numbered files of migrations/, which change every database
migrated before.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import LiteralString, cast

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_INCLUDE = re.compile(r"^-- include: (\w+)\s*$", re.MULTILINE)
_COMMENT_LINE = re.compile(r"^[ \t]*--.*\n?", re.MULTILINE)
_INDENT = re.compile(r"\n[ \t]+")
SCHEMA_FILE = "schema.sql"


_PARAM = re.compile(r"%\((\w+)\)s")


def numbered(query: str) -> tuple[str, list[str]]:
    """The query with its %(name)s placeholders as $1.. (as psycopg sends it), and the names
    in their order: for statements sent through libpq directly, and for PREPARE."""
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m[1] not in names:
            names.append(m[1])
        return f"${names.index(m[1]) + 1}"

    return _PARAM.sub(number, query), names


def parse_queries(text: str, source: str = "<sql>") -> dict[str, str]:
    parts = _NAME.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"{source}: query {name!r} is defined twice")
        queries[name] = body.strip()
    return queries


def _load() -> dict[str, LiteralString]:
    found: dict[str, str] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql") and entry.name != SCHEMA_FILE:
            for name, body in parse_queries(entry.read_text(), entry.name).items():
                if name in found:
                    raise ValueError(f"{entry.name}: query {name!r} is defined twice")
                found[name] = body
    return cast(dict[str, LiteralString], without_comments(resolve_includes(found)))


def resolve_includes(blocks: dict[str, str]) -> dict[str, str]:
    """Statements with their `-- include:` lines replaced, in fragments too; fragments
    themselves left out."""

    def expand(match: re.Match[str], within: tuple[str, ...] = ()) -> str:
        name = match.group(1)
        if not name.startswith("_") or name not in blocks:
            raise ValueError(f"-- include: {name}: no such fragment (fragments start with _)")
        if name in within:
            raise ValueError(f"-- include: {name}: includes itself ({' > '.join(within)})")
        return _INCLUDE.sub(lambda m: expand(m, (*within, name)), blocks[name])

    return {
        name: _INCLUDE.sub(expand, body)
        for name, body in blocks.items()
        if not name.startswith("_")
    }


def without_comments(statements: dict[str, str]) -> dict[str, str]:
    """Statements as sent: comment lines give way to one naming the statement.

    The comments are for readers of these files. Sent along, they made the hot statements
    longer than the 4 kB up to which psycopg caches its parse of a query's placeholders, so
    every execution parsed it again (see bench/README.md, "Figures behind the code's
    comments"). The name line still tells which statement a session in pg_stat_activity is
    running. Each line's indentation goes too (no statement has a string spanning lines): it
    took a sixth of steps_dispatch.
    """
    return {
        name: f"-- cyclone: {name}\n" + _INDENT.sub("\n", _COMMENT_LINE.sub("", body))
        for name, body in statements.items()
    }


QUERIES: dict[str, LiteralString] = _load()


def current_schema() -> str:
    """The schema a migrated database has, as one commented SQL script (schema.sql)."""
    return (resources.files(__package__) / SCHEMA_FILE).read_text()


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every file in migrations/, in order."""
    out = []
    folder = resources.files(__package__) / "migrations"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            version, _, slug = entry.name.removesuffix(".sql").partition("_")
            out.append((int(version), slug, entry.read_text()))
    return out

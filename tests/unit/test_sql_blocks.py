"""The named SQL blocks of cyclone/sql/*.sql, as parsed: unique names, fragments included,
comments left out of what is sent. No database: tests/db/test_schema.py runs them."""

from __future__ import annotations

import re

import pytest

from cyclone.sql import QUERIES, parse_queries


def test_every_named_query_is_unique_and_nonempty():
    assert QUERIES and all(body.strip() for body in QUERIES.values())
    with pytest.raises(ValueError, match="twice"):
        parse_queries("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


def test_statements_are_sent_without_comments_and_short_enough_for_psycopg_to_cache():
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH  # its parse cache's limit

    from cyclone.sql import without_comments

    assert without_comments({"a": "-- why\nSELECT 1 -- not a line comment\n  -- how\nFROM t"}) == {
        "a": "-- cyclone: a\nSELECT 1 -- not a line comment\nFROM t"
    }
    for name, body in QUERIES.items():
        assert body.startswith(f"-- cyclone: {name}\n")
        assert not re.search(r"\n[ \t]*--", body), name
        # Longer, psycopg would parse its placeholders again on every execution.
        assert len(body.encode()) <= MAX_CACHED_STATEMENT_LENGTH, name


def test_fragments_are_included_once_and_an_unknown_one_is_an_error():
    from cyclone.sql import resolve_includes

    blocks = {
        "_tail": "SELECT 1;",
        "a": "-- include: _tail",
        "b": "WITH x AS (SELECT 2)\n-- include: _tail",
    }
    assert resolve_includes(blocks) == {"a": "SELECT 1;", "b": "WITH x AS (SELECT 2)\nSELECT 1;"}
    with pytest.raises(ValueError, match="no such fragment"):
        resolve_includes({"a": "-- include: _missing"})
    assert not any(name.startswith("_") for name in QUERIES)


def test_a_fragment_includes_fragments_and_one_that_includes_itself_is_an_error():
    from cyclone.sql import resolve_includes

    blocks = {
        "_inner": "SELECT 1;",
        "_outer": "WITH x AS (SELECT 2)\n-- include: _inner",
        "a": "-- a\n-- include: _outer",
    }
    assert resolve_includes(blocks) == {"a": "-- a\nWITH x AS (SELECT 2)\nSELECT 1;"}
    with pytest.raises(ValueError, match="includes itself"):
        resolve_includes({"_x": "-- include: _y", "_y": "-- include: _x", "a": "-- include: _x"})
    # steps_dispatch's fragments include the steps a completion makes (_make_next).
    assert "INSERT INTO cyclone_steps" in QUERIES["steps_dispatch_plain"]

"""Forward-only, numbered schema migrations applied under an advisory lock."""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from cyclone.db import connect, resolve_dsn
from cyclone.sql import QUERIES, migrations

logger = logging.getLogger(__name__)


def migrate(target: str | psycopg.Connection[Any] | None = None) -> list[int]:
    """Apply every pending migration to the connection's schema; return the versions applied."""
    if isinstance(target, psycopg.Connection):
        return _migrate(target)
    with connect(resolve_dsn(target)) as conn:
        return _migrate(conn)


def _migrate(conn: psycopg.Connection[Any]) -> list[int]:
    # One transaction, under a lock it holds to its end: behind a transaction-mode pooler a
    # session-level lock could be taken on one server connection and released (or not) on
    # another. The other migrators wait for the lock, then find nothing left to do. A failed
    # migration takes the ones before it in this call back with it; the next call redoes them.
    applied_now: list[tuple[int, str]] = []
    with conn.transaction():
        conn.execute(QUERIES["migration_lock"])
        done = _applied(conn) if _present(conn) else set()
        if done >= {version for version, _, _ in migrations()}:
            return []  # no DDL at all: a role without DDL rights gets here too
        conn.execute(QUERIES["migration_table_create"])
        done = _applied(conn)
        for version, name, sql in migrations():
            if version not in done:
                conn.execute(sql.encode())  # type: ignore[arg-type] - a whole file of DDL
                conn.execute(QUERIES["migration_record"], {"version": version, "name": name})
                applied_now.append((version, name))
    for version, name in applied_now:
        logger.info(
            "applied migration %04d_%s", version, name, extra={"action": "migration_applied"}
        )
    return [version for version, _ in applied_now]


def _present(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(QUERIES["migration_table_present"]).fetchone()
    return bool(row[0] if isinstance(row, tuple) else row["present"])


def _applied(conn: psycopg.Connection[Any]) -> set[int]:
    return {
        row[0] if isinstance(row, tuple) else row["version"]
        for row in conn.execute(QUERIES["migration_applied"]).fetchall()
    }


def latest_version() -> int:
    return max(v for v, _, _ in migrations())

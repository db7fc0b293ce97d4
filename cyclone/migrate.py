"""Forward-only, numbered schema migrations applied under an advisory lock.

A schema Cyclone was never migrated into (no cyclone_migrations table) is made in one go from
schema.sql, the schema as it stands after the last migration, with every migration recorded
as applied: a fresh install, and each test's TestEnv, then run one script instead of every
file of migrations/ in turn (about 40 ms instead of 110). tests/db/test_schema_file.py holds
the two ways to the same catalog, rows and sequence values; it migrates file by file
(`each_file=True`), as do the tests of upgrades from an older version.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from cyclone.db import connect, resolve_dsn
from cyclone.errors import CycloneError
from cyclone.sql import QUERIES, current_schema, migrations

logger = logging.getLogger(__name__)


# How long `migrate` waits for another migrator's lock before it gives up, saying so. Any role
# that may connect can take that advisory lock and keep it: a supervisor starting with
# `[database] migrate = true` waited for it forever, even with nothing to migrate.
LOCK_TIMEOUT = 120.0


class MigrationLocked(CycloneError):
    """Another session held the migration lock longer than `migrate` waits."""


def migrate(
    target: str | psycopg.Connection[Any] | None = None,
    *,
    lock_timeout: float | None = None,
    each_file: bool = False,
) -> list[int]:
    """Apply every pending migration to the connection's schema; return the versions applied.
    MigrationLocked when another session holds the lock longer than `lock_timeout` seconds
    (default LOCK_TIMEOUT). A schema never migrated is made from schema.sql in one script,
    unless `each_file`: then every migration file runs in turn, as on an older database."""
    if lock_timeout is None:
        lock_timeout = LOCK_TIMEOUT
    if isinstance(target, psycopg.Connection):
        return _migrate(target, lock_timeout, each_file)
    with connect(resolve_dsn(target)) as conn:
        return _migrate(conn, lock_timeout, each_file)


def _pending(conn: psycopg.Connection[Any]) -> bool:
    done = _applied(conn) if _present(conn) else set()
    return not done >= {version for version, _, _ in migrations()}


def _migrate(
    conn: psycopg.Connection[Any], lock_timeout: float = LOCK_TIMEOUT, each_file: bool = False
) -> list[int]:
    # Current already: no lock and no DDL (a role without DDL rights gets here too), so that
    # whoever holds the lock cannot stop a start-up that has nothing to migrate.
    with conn.transaction():
        if not _pending(conn):
            return []
    # One transaction, under a lock it holds to its end: behind a transaction-mode pooler a
    # session-level lock could be taken on one server connection and released (or not) on
    # another. The other migrators wait for the lock, then find nothing left to do. A failed
    # migration takes the ones before it in this call back with it; the next call redoes them.
    with conn.transaction():
        _lock(conn, lock_timeout)
        if not _pending(conn):
            return []  # another migrator did it while this one waited
        fresh = not each_file and not _present(conn)
        if fresh:
            applied_now = [(version, name) for version, name, _ in migrations()]
            _install(conn, current_schema(), applied_now)
        else:
            applied_now = _apply_each(conn)
    if fresh:
        logger.info(
            "made the schema at version %d from schema.sql (migrations %s recorded as applied)",
            applied_now[-1][0],
            ", ".join(str(v) for v, _ in applied_now),
            extra={"action": "migration_applied"},
        )
    else:
        for version, name in applied_now:
            logger.info(
                "applied migration %04d_%s", version, name, extra={"action": "migration_applied"}
            )
    return [version for version, _ in applied_now]


def _apply_each(conn: psycopg.Connection[Any]) -> list[tuple[int, str]]:
    """Every migration file not yet applied, in order; inside _migrate's transaction and lock."""
    conn.execute(QUERIES["migration_table_create"])
    done = _applied(conn)
    applied_now: list[tuple[int, str]] = []
    for version, name, sql in migrations():
        if version not in done:
            conn.execute(sql.encode())  # type: ignore[arg-type] - a whole file of DDL
            conn.execute(QUERIES["migration_record"], {"version": version, "name": name})
            applied_now.append((version, name))
    return applied_now


def install(conn: psycopg.Connection[Any], script: str, versions: list[tuple[int, str]]) -> None:
    """Make the connection's schema, known to be new and empty, from `script` (schema.sql's
    text), recording `versions` (version, name) as applied: `migrate`'s way for a schema never
    migrated, for callers that read the two beforehand (cyclone.testing_schemas makes schemas
    in a thread while a test may patch this module's `migrations`)."""
    with conn.transaction():
        _lock(conn, LOCK_TIMEOUT)
        _install(conn, script, versions)


def _install(conn: psycopg.Connection[Any], script: str, versions: list[tuple[int, str]]) -> None:
    conn.execute(script.encode())  # type: ignore[arg-type] - a whole script of DDL
    conn.execute(QUERIES["migration_table_create"])
    conn.execute(
        QUERIES["migration_record_all"],
        {"versions": [v for v, _ in versions], "names": [n for _, n in versions]},
    )


def _lock(conn: psycopg.Connection[Any], timeout: float) -> None:
    row = conn.execute(
        QUERIES["migration_lock_timeout"], {"timeout": f"{max(0, int(timeout * 1000))}ms"}
    ).fetchone()
    previous, schema = (
        (row[0], row[1]) if isinstance(row, tuple) else (row["previous"], row["schema"])
    )
    try:
        conn.execute(QUERIES["migration_lock"])
    except psycopg.errors.LockNotAvailable:
        raise MigrationLocked(
            f"another session has held the migration lock of schema {schema!r} for over "
            f"{timeout:g}s (an advisory lock: see pg_locks where locktype = 'advisory'); "
            "nothing was migrated"
        ) from None
    conn.execute(QUERIES["migration_lock_timeout_restore"], {"previous": previous})


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

"""Short-lived connections with a statement_timeout, checked once per process.

The supervisor opens its connections through `connect_briefly`, and so does the scanner it
forks: every statement has a time limit, and a pooler that drops the startup option is said
once (on the first connection of the process) rather than silently ignored.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from cyclone.db import connect, with_options
from cyclone.sql import QUERIES

log = logging.getLogger(__name__)

# The supervisor's loop enforces kills: none of its database calls may stall it for long.
CONNECT_TIMEOUT = 2
STATEMENT_TIMEOUT_MS = 2000


def connect_briefly(
    dsn: str,
    statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
    name: str = "cyclone-supervisor",
    connect_timeout: int = CONNECT_TIMEOUT,
) -> psycopg.Connection[Any]:
    global _timeout_checked
    conn = connect(
        with_options(dsn, f"-c statement_timeout={statement_timeout_ms}"), name,
        connect_timeout=connect_timeout,
    )  # fmt: skip
    if not _timeout_checked:
        _timeout_checked = True  # the first connection tells for all: one DSN, one path
        check_statement_timeout(conn, statement_timeout_ms)
    return conn


# Once a process (forked children inherit it): one query on the first connection.
_timeout_checked = False


def check_statement_timeout(conn: psycopg.Connection[Any], wanted_ms: int) -> bool:
    """Whether the session got the statement_timeout asked for; if not, say so (once)."""
    try:
        got = conn.execute(QUERIES["session_statement_timeout"]).fetchone()["ms"]
    except psycopg.Error:
        return False  # the caller's next statement meets the same trouble and reports it
    if got == wanted_ms:
        return True
    log.warning(
        "statement_timeout is %d ms, not the %d ms asked for: something between here and "
        "PostgreSQL (a pooler ignoring startup options) dropped it, so the supervisor's calls "
        "have no time limit; set one there (PgBouncer: query_timeout) or on the role",
        got, wanted_ms, extra={"action": "connect"},
    )  # fmt: skip
    return False

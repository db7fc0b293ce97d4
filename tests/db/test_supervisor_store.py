"""The supervisor's store: one kept connection, replaced (and the call made again) once lost."""

from __future__ import annotations

import psycopg
import pytest

from cyclone.child.session import connect_briefly
from cyclone.supervisor.store import DatabaseStore
from cyclone.testing import TestEnv

TOKEN = "00000000-0000-4000-8000-000000000001"
KILL_OWN_SESSION = "SELECT pg_terminate_backend(pg_backend_pid())"


def counting_store(env: TestEnv) -> tuple[DatabaseStore, list[int]]:
    opened: list[int] = []

    def connect() -> psycopg.Connection:
        conn = connect_briefly(env.dsn)
        opened.append(conn.info.backend_pid)
        return conn

    return DatabaseStore(env.dsn, batch_size=10, connect=connect), opened


def test_checks_share_one_connection_and_one_that_died_idle_is_replaced(env: TestEnv) -> None:
    store, opened = counting_store(env)
    # A step that does not exist holds no lease: revoked, with no reason.
    assert store.revoked({1: TOKEN}) == {1: None}
    assert store.revoked({1: TOKEN}) == {1: None}
    assert store.sweep_deadlines() == 0
    assert len(opened) == 1
    # The server ends the idle session (a restart, a pooler, an idle timeout): the next call
    # finds out, and is made again on a new connection instead of failing.
    env.conn.execute("SELECT pg_terminate_backend(%s)", (opened[0],))
    assert store.revoked({1: TOKEN}) == {1: None}
    assert len(opened) == 2 and opened[1] != opened[0]
    store.close()
    assert store.session.conn is None


def test_a_statement_that_fails_keeps_the_session_and_is_not_made_again(env: TestEnv) -> None:
    store, opened = counting_store(env)
    calls: list[int] = []

    def divide(conn: psycopg.Connection) -> None:
        calls.append(conn.info.backend_pid)
        conn.execute("SELECT 1 / 0")

    store.revoked({1: TOKEN})
    with pytest.raises(psycopg.errors.DivisionByZero):
        store._call(divide)
    assert calls == opened and len(opened) == 1
    assert store.revoked({1: TOKEN}) == {1: None} and len(opened) == 1
    store.close()


def test_a_session_lost_twice_in_a_row_fails_the_call(env: TestEnv) -> None:
    store, opened = counting_store(env)
    # A new session that dies at once is not tried again: the database itself is in trouble.
    with pytest.raises(psycopg.OperationalError):
        store._call(lambda conn: conn.execute(KILL_OWN_SESSION))
    assert len(opened) == 1 and store.session.conn is None
    # A kept one is tried again once, on a new session, and no more.
    store.revoked({1: TOKEN})
    with pytest.raises(psycopg.OperationalError):
        store._call(lambda conn: conn.execute(KILL_OWN_SESSION))
    assert len(opened) == 3 and store.session.conn is None
    assert store.revoked({1: TOKEN}) == {1: None} and len(opened) == 4
    store.close()

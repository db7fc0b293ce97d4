"""The recipes of docs/clients.md: a submit that commits or rolls back with the app's own writes.

psycopg's (sync and async) always run; SQLAlchemy's and Django's run where they are installed
(neither is a dependency of Cyclone).
"""

from __future__ import annotations

import asyncio
import importlib.util

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

import cyclone
from cyclone import engine
from cyclone.testing import TestEnv

orders = cyclone.Workflow("tx-orders")


@orders.task()
def ship(ctx):
    return ctx.input["item"]


class Rollback(Exception):
    """Raised inside the app's transaction to roll it back."""


@pytest.fixture
def app(env: TestEnv) -> TestEnv:
    """The env, with the app's own table beside Cyclone's (as one database holds both)."""
    env.conn.execute("CREATE TABLE app_orders (id serial PRIMARY KEY, item text NOT NULL)")
    env.register(orders)
    return env


def _outcome(env: TestEnv, run_ids: list[str]) -> tuple[list[str], list[str]]:
    """(the app's rows, the runs' states), after the app's transactions."""
    items = [r["item"] for r in env.conn.execute("SELECT item FROM app_orders ORDER BY id")]
    runs = env.conn.execute(
        "SELECT id::text FROM cyclone_runs WHERE id = ANY(%s::uuid[])", (run_ids,)
    ).fetchall()
    return items, [r["id"] for r in runs]


def _leased(env: TestEnv, run_id: str) -> bool:
    lease = engine.lease_step(env.conn, worker="t", workflows=[orders.name], lease_ttl=60)
    return lease is not None and str(lease.run_id) == run_id


def _check(env: TestEnv, kept: str, dropped: str) -> None:
    items, runs = _outcome(env, [kept, dropped])
    assert items == ["kept"] and runs == [kept]
    assert _leased(env, kept)


def test_psycopg(app: TestEnv):
    client = cyclone.Client(app.dsn)
    with psycopg.connect(app.dsn) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO app_orders (item) VALUES (%s)", ("kept",))
            kept = client.submit(orders, {"item": "kept"}, conn=conn)
        with pytest.raises(Rollback), conn.transaction():
            conn.execute("INSERT INTO app_orders (item) VALUES (%s)", ("dropped",))
            dropped = client.submit(orders, {"item": "dropped"}, conn=conn)
            raise Rollback
    _check(app, kept, dropped)
    client.close()


def test_psycopg_rolled_back_first_submit_leaves_the_client_able_to_submit(env: TestEnv):
    # The graph registered in a rolled-back transaction is gone: the client must register it
    # again rather than believe it did.
    fresh = cyclone.Workflow("tx-fresh")
    fresh.wait("w")
    with cyclone.Client(env.dsn) as client:
        with psycopg.connect(env.dsn) as conn:
            client.submit(fresh, {}, conn=conn)
            conn.rollback()
        assert client.get_run(client.submit(fresh, {})).state == "running"


def test_psycopg_async(app: TestEnv):
    async def main() -> tuple[str, str]:
        async with (
            cyclone.AsyncClient(app.dsn) as client,
            await psycopg.AsyncConnection.connect(app.dsn) as conn,
        ):
            async with conn.transaction():
                await conn.execute("INSERT INTO app_orders (item) VALUES (%s)", ("kept",))
                kept = await client.submit(orders, {"item": "kept"}, conn=conn)
            with pytest.raises(Rollback):
                async with conn.transaction():
                    await conn.execute("INSERT INTO app_orders (item) VALUES (%s)", ("dropped",))
                    dropped = await client.submit(orders, {"item": "dropped"}, conn=conn)
                    raise Rollback
        return kept, dropped

    _check(app, *asyncio.run(main()))


_NO_SQLALCHEMY = "SQLAlchemy is not installed (not a Cyclone dependency)"


@pytest.mark.skipif(importlib.util.find_spec("sqlalchemy") is None, reason=_NO_SQLALCHEMY)
def test_sqlalchemy_session(app: TestEnv):
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    db = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(app.dsn))
    client = cyclone.Client(app.dsn)
    insert = text("INSERT INTO app_orders (item) VALUES (:item)")
    with Session(db) as session, session.begin():
        session.execute(insert, {"item": "kept"})
        raw = session.connection().connection.driver_connection  # psycopg's Connection
        kept = client.submit(orders, {"item": "kept"}, conn=raw)
    with pytest.raises(Rollback), Session(db) as session, session.begin():
        session.execute(insert, {"item": "dropped"})
        raw = session.connection().connection.driver_connection
        dropped = client.submit(orders, {"item": "dropped"}, conn=raw)
        raise Rollback
    _check(app, kept, dropped)
    client.close()
    db.dispose()


@pytest.mark.skipif(
    importlib.util.find_spec("sqlalchemy") is None or importlib.util.find_spec("greenlet") is None,
    reason=f"{_NO_SQLALCHEMY}, or not with its asyncio extra (greenlet)",
)
def test_sqlalchemy_async_session(app: TestEnv):
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    insert = text("INSERT INTO app_orders (item) VALUES (:item)")

    async def main() -> tuple[str, str]:
        db = create_async_engine(
            "postgresql+psycopg://", async_creator=lambda: psycopg.AsyncConnection.connect(app.dsn)
        )
        async with cyclone.AsyncClient(app.dsn) as client:
            async with AsyncSession(db) as session, session.begin():
                await session.execute(insert, {"item": "kept"})
                raw = (await (await session.connection()).get_raw_connection()).driver_connection
                kept = await client.submit(orders, {"item": "kept"}, conn=raw)
            with pytest.raises(Rollback):
                async with AsyncSession(db) as session, session.begin():
                    await session.execute(insert, {"item": "dropped"})
                    conn = await session.connection()
                    raw = (await conn.get_raw_connection()).driver_connection
                    dropped = await client.submit(orders, {"item": "dropped"}, conn=raw)
                    raise Rollback
        await db.dispose()
        return kept, dropped

    _check(app, *asyncio.run(main()))


@pytest.mark.skipif(
    importlib.util.find_spec("django") is None,
    reason="Django is not installed (not a Cyclone dependency)",
)
def test_django_connection(app: TestEnv):
    import django
    from django.conf import settings
    from django.db import connections, transaction

    if not settings.configured:
        settings.configure(DATABASES={}, USE_TZ=True)
        django.setup()
    params = conninfo_to_dict(app.dsn)
    alias = f"cyclone_{app.schema}"
    connections.settings[alias] = connections.settings.setdefault(alias, {})
    connections.settings[alias].update(
        ENGINE="django.db.backends.postgresql",
        NAME=params.get("dbname"),
        USER=params.get("user"),
        PASSWORD=params.get("password", ""),
        HOST=params.get("host", ""),
        PORT=params.get("port", ""),
        OPTIONS={"options": params["options"]},
    )
    connections.configure_settings(connections.settings)
    client = cyclone.Client(app.dsn)
    db = connections[alias]
    try:
        with transaction.atomic(using=alias):
            with db.cursor() as cur:
                cur.execute("INSERT INTO app_orders (item) VALUES (%s)", ["kept"])
            kept = client.submit("tx-orders", {"item": "kept"}, conn=db.connection)
        with pytest.raises(Rollback), transaction.atomic(using=alias):
            with db.cursor() as cur:
                cur.execute("INSERT INTO app_orders (item) VALUES (%s)", ["dropped"])
            dropped = client.submit(orders, {"item": "dropped"}, conn=db.connection)
            raise Rollback
    finally:
        db.close()
        client.close()
    _check(app, kept, dropped)

"""The engine's synchronous code, run by AsyncClient on an AsyncConnection.

Cancel, pause, resume and signal walk run trees in Python (engine/control.py and advance.py,
the code workers and the scanner run too): a cancel finishes the run's parent, which may
complete the grandparent... Rather than a second, asynchronous copy of those rules, AsyncClient
runs the same functions in a thread, on a `SyncView` of its async connection: each statement is
handed back to the event loop, which runs it on the AsyncConnection while the thread waits.
These calls are rare next to submits and reads, which cyclone.clients.calls runs natively.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg

T = TypeVar("T")


class Rows:
    """A statement's rows, read in full: what the engine reads of a cursor."""

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def fetchone(self) -> Any:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[Any]:
        rows, self._rows = self._rows, []
        return rows

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fetchall())


class SyncView:
    """`execute` and `transaction` of an AsyncConnection, callable from another thread."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn
        self._loop = loop

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def execute(self, query: Any, params: Any = None) -> Rows:
        return self._run(self._execute(query, params))

    async def _execute(self, query: Any, params: Any) -> Rows:
        cur = await self._conn.execute(query, params)
        rows = await cur.fetchall() if cur.description is not None else []
        return Rows(rows, cur.rowcount)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        tx = self._conn.transaction()
        self._run(tx.__aenter__())
        try:
            yield
        except BaseException as exc:
            if not self._run(tx.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self._run(tx.__aexit__(None, None, None))


async def run_sync(
    conn: psycopg.AsyncConnection[Any], fn: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """`fn(view_of_conn, *args, **kwargs)` in a thread, its statements run on `conn` here."""
    view = SyncView(conn, asyncio.get_running_loop())
    return await asyncio.to_thread(fn, view, *args, **kwargs)

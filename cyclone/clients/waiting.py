"""Waiting for runs to end: one watcher connection per client, however many wait.

Every waiter registers a future for its run, then looks at the run once itself, marking it as
waited for (run_wait_register) so that its end is notified: migration 10's trigger sends a
notification on cyclone_run_ended, in the transaction that ends a run, for such runs only.
One watcher per client (a thread for Client, a task for AsyncClient), on one connection of its
own, LISTENs and settles the futures of the runs named, reading all of them in one statement
(runs_get_ended) on that same connection. It also checks every run waited for at an interval:
often (POLL_UNHEARD) while notifications are not known to arrive, rarely (POLL_HEARD) as a
safety net while they do. Whether they arrive, a probe sent from another session tells once,
when the watcher first connects: behind PgBouncer in transaction mode LISTEN succeeds but
nothing is ever delivered, and the watcher then only polls (and waiters no longer mark their
runs). It starts with the first wait and lives until the client is closed; a lost connection
is opened again, and every run waited for is then looked at.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import select
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

import psycopg

from cyclone.clients.calls import adrive, drive, ended_call, probe_call
from cyclone.db import connect
from cyclone.models import RunStatus
from cyclone.sql import QUERIES

log = logging.getLogger(__name__)

POLL_UNHEARD = 0.5
POLL_HEARD = 10.0
PROBE_TIMEOUT = 1.0
LISTEN_RETRY = 5.0
NAME = "cyclone-waiter"

F = TypeVar("F", concurrent.futures.Future, asyncio.Future)  # type: ignore[type-arg]


class Watch(Generic[F]):
    """Which futures wait for which runs, and which runs to look at after a wake-up."""

    def __init__(self, listen: bool) -> None:
        self.listen = listen  # wanted, and not found not to work
        self.heard = False  # notifications were seen to arrive (the probe's)
        self.probed = False
        self.listening = False  # on a connection that is up
        self._lock = threading.Lock()
        self._waiting: dict[str, list[F]] = {}
        self._last_poll = time.monotonic()

    def add(self, run_id: str, future: F) -> F:
        with self._lock:
            self._waiting.setdefault(run_id, []).append(future)
        return future

    def discard(self, run_id: str, future: F) -> None:
        with self._lock:
            futures = self._waiting.get(run_id)
            if futures and future in futures:
                futures.remove(future)
                if not futures:
                    del self._waiting[run_id]

    @property
    def interval(self) -> float:
        return POLL_HEARD if self.listening and self.heard else POLL_UNHEARD

    def due(self, woken: Iterable[str] | None) -> list[str]:
        """The runs to look at: those named by notifications, or all of them once a poll is due
        (`woken` None: the wait timed out)."""
        with self._lock:
            now = time.monotonic()
            if woken is None or now - self._last_poll >= self.interval:
                self._last_poll = now
                return list(self._waiting)
            return [r for r in set(woken) if r in self._waiting]

    def settle(self, statuses: Iterable[RunStatus]) -> None:
        for status in statuses:
            with self._lock:
                futures = self._waiting.pop(status.id, [])
            for future in futures:
                if not future.done():
                    future.set_result(status)

    @property
    def register(self) -> bool:
        """Whether waiters mark their runs for a notification: not once the watcher polls."""
        return self.listen

    def probe_token(self) -> str:
        return f"probe:{uuid.uuid4()}"

    @property
    def mode(self) -> str:
        return "LISTEN/NOTIFY" if self.heard else "polling (notifications do not arrive)"


class ThreadWatcher:
    """Client's watcher: a daemon thread, woken by its socket, a timeout or close()."""

    def __init__(self, dsn: str, *, listen: bool = True) -> None:
        self.dsn = dsn
        self.watch: Watch[concurrent.futures.Future[RunStatus]] = Watch(listen)
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self._conn: psycopg.Connection[Any] | None = None

    def add(self, run_id: str) -> concurrent.futures.Future[RunStatus]:
        with self._start:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=NAME, daemon=True)
                self._thread.start()
        return self.watch.add(run_id, concurrent.futures.Future())

    def discard(self, run_id: str, future: concurrent.futures.Future[RunStatus]) -> None:
        self.watch.discard(run_id, future)

    def close(self) -> None:
        with self._start:
            self._closed = True
            thread = self._thread
        if thread is not None:
            os.write(self._wake_w, b"x")
            thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        retry_at = 0.0
        woken: set[str] | None = None
        try:
            while not self._closed:
                if self._conn is None and time.monotonic() >= retry_at:
                    try:
                        self._open()
                        woken = None
                    except psycopg.Error as exc:
                        log.warning("cannot watch for run ends: %s", exc)
                        self._drop()
                        retry_at = time.monotonic() + LISTEN_RETRY
                if self._conn is not None and (ids := self.watch.due(woken)):
                    try:
                        self.watch.settle(drive(ended_call(ids), self._conn))
                    except psycopg.Error as exc:
                        log.warning("lost the connection watching for run ends: %s", exc)
                        self._drop()
                woken = self._next_wake()
        finally:
            self._drop()

    def _open(self) -> None:
        """Connect; LISTEN unless notifications were found not to arrive (probed once)."""
        conn = self._conn = connect(self.dsn, NAME)
        if not self.watch.listen:
            return
        conn.execute(QUERIES["run_end_listen"])
        if not self.watch.probed:
            self.watch.probed = True
            token = self.watch.probe_token()
            with connect(self.dsn, NAME) as other:
                drive(probe_call(token), other)
            with contextlib.closing(conn.notifies(timeout=PROBE_TIMEOUT)) as arriving:
                self.watch.heard = any(n.payload == token for n in arriving)
            log.info("waiting for run ends: %s", self.watch.mode)
            if not self.watch.heard:
                self.watch.listen = False
                conn.execute(QUERIES["run_end_unlisten"])
                return
        self.watch.listening = True

    def _next_wake(self) -> set[str] | None:
        """What woke the thread: notifications (their payloads), close() (nothing), or the
        interval passing (None: look at every run)."""
        listening = self._conn if self.watch.listening else None
        fds = [self._wake_r] + ([listening.fileno()] if listening is not None else [])
        ready, _, _ = select.select(fds, [], [], self.watch.interval)
        if not ready:
            return None
        if self._wake_r in ready:
            os.read(self._wake_r, 64)
        if listening is None or listening.fileno() not in ready:
            return set()
        try:
            return {n.payload for n in listening.notifies(timeout=0)}
        except psycopg.Error as exc:
            log.warning("lost the connection watching for run ends: %s", exc)
            self._drop()
            return None

    def _drop(self) -> None:
        self.watch.listening = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class AsyncWatcher:
    """AsyncClient's watcher: one task on the client's event loop."""

    def __init__(self, dsn: str, *, listen: bool = True) -> None:
        self.dsn = dsn
        self.watch: Watch[asyncio.Future[RunStatus]] = Watch(listen)
        self._task: asyncio.Task[None] | None = None
        self._conn: psycopg.AsyncConnection[Any] | None = None

    def add(self, run_id: str) -> asyncio.Future[RunStatus]:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name=NAME)
        return self.watch.add(run_id, loop.create_future())

    def discard(self, run_id: str, future: asyncio.Future[RunStatus]) -> None:
        self.watch.discard(run_id, future)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        retry_at = 0.0
        woken: set[str] | None = None
        try:
            while True:
                if self._conn is None and time.monotonic() >= retry_at:
                    try:
                        await self._open()
                        woken = None
                    except psycopg.Error as exc:
                        log.warning("cannot watch for run ends: %s", exc)
                        await self._drop()
                        retry_at = time.monotonic() + LISTEN_RETRY
                if self._conn is not None and (ids := self.watch.due(woken)):
                    try:
                        self.watch.settle(await adrive(ended_call(ids), self._conn))
                    except psycopg.Error as exc:
                        log.warning("lost the connection watching for run ends: %s", exc)
                        await self._drop()
                woken = await self._next_wake()
        finally:
            await self._drop()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, fallback_application_name=NAME
        )

    async def _open(self) -> None:
        """Connect; LISTEN unless notifications were found not to arrive (probed once)."""
        conn = self._conn = await self._connect()
        if not self.watch.listen:
            return
        await conn.execute(QUERIES["run_end_listen"])
        if not self.watch.probed:
            self.watch.probed = True
            token = self.watch.probe_token()
            async with await self._connect() as other:
                await adrive(probe_call(token), other)
            async with contextlib.aclosing(conn.notifies(timeout=PROBE_TIMEOUT)) as arriving:
                async for n in arriving:
                    if n.payload == token:
                        self.watch.heard = True
                        break
            log.info("waiting for run ends: %s", self.watch.mode)
            if not self.watch.heard:
                self.watch.listen = False
                await conn.execute(QUERIES["run_end_unlisten"])
                return
        self.watch.listening = True

    async def _next_wake(self) -> set[str] | None:
        if not self.watch.listening or self._conn is None:
            await asyncio.sleep(self.watch.interval)
            return None
        try:
            got = [n.payload async for n in self._conn.notifies(
                timeout=self.watch.interval, stop_after=1)]  # fmt: skip
            if not got:
                return None
            # Whatever else already arrived, so one statement reads them all.
            got += [n.payload async for n in self._conn.notifies(timeout=0)]
        except psycopg.Error as exc:
            log.warning("lost the connection watching for run ends: %s", exc)
            await self._drop()
            return None
        return set(got)

    async def _drop(self) -> None:
        self.watch.listening = False
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.close()

"""`cyclone.AsyncClient`: every method of Client as `async def`, on psycopg's async connections.

Submits, reads and waits run cyclone/clients/calls.py's calls (the same checks and statements as
Client's) on an AsyncConnection from psycopg's async pool, or on the caller's own connection
(`conn=`), joining its transaction. Cancel, pause, resume and signal run the engine's own code
through bridge.py. Waiters share one listening connection (waiting.py).

An AsyncClient belongs to the event loop that first uses it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from cyclone import engine
from cyclone.clients.bridge import run_sync
from cyclone.clients.calls import (
    Call,
    Calls,
    adrive,
    outcome,
    remaining,
    run_uuid,
    timeout_seconds,
)
from cyclone.clients.waiting import AsyncWatcher
from cyclone.models import AttemptInfo, ExhaustedQuery, RunStatus, StepInfo
from cyclone.schedules import DEFAULT_CATCHUP, ScheduleInfo
from cyclone.workflow import Workflow

AConn = psycopg.AsyncConnection[Any]
T = TypeVar("T")


class AsyncClient(Calls):
    """Talks to Cyclone's tables from asyncio; connections come from a small async pool.

    `async with AsyncClient(dsn) as client:` closes it on the way out (or `await close()`).
    """

    def __init__(self, dsn: str | None = None, **options: Any) -> None:
        super().__init__(dsn, **options)
        self._pool: AsyncConnectionPool | None = None
        self._watcher: AsyncWatcher | None = None
        self._closed = False

    # -- connections ---

    @asynccontextmanager
    async def connection(self, conn: AConn | None = None) -> AsyncIterator[AConn]:
        """The caller's connection when given, else one from the pool."""
        if conn is not None:
            yield conn
            return
        if self._closed:
            # Tasks still running when the client closed must not open a new pool.
            raise RuntimeError("the AsyncClient is closed")
        if self._pool is None:
            # No await between the test and the assignment: one pool, however many tasks.
            self._pool = AsyncConnectionPool(
                self.dsn,
                min_size=1,
                max_size=self._pool_size,
                open=False,
                kwargs={
                    "autocommit": True,
                    "row_factory": dict_row,
                    "fallback_application_name": "cyclone",
                    "prepare_threshold": self._prepare_threshold,
                },
            )
        pool = self._pool
        await pool.open()  # a no-op once open
        async with pool.connection() as pooled:
            yield pooled

    async def _run(self, call: Call[T], conn: AConn | None = None) -> T:
        """A call in one transaction of its own, or in the caller's (which decides its fate)."""
        async with self.connection(conn) as c:
            if conn is not None:
                return await adrive(call, c)
            async with c.transaction():
                return await adrive(call, c)

    async def _engine(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One of the engine's functions on a pooled connection (see cyclone/clients/bridge.py)."""

        async def call() -> T:
            async with self.connection() as c:
                return await run_sync(c, fn, *args, **kwargs)

        # Shielded: the thread cannot be stopped, so its connection goes back to the pool only
        # once the call is over, even when the caller stopped waiting for it.
        return await asyncio.shield(asyncio.ensure_future(call()))

    async def close(self) -> None:
        self._closed = True
        watcher, self._watcher = self._watcher, None
        pool, self._pool = self._pool, None
        if watcher is not None:
            await watcher.close()
        if pool is not None:
            await pool.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- submitting ---

    async def submit(
        self,
        workflow: Workflow | str,
        input: Any = None,
        *,
        run_deadline: timedelta | float | None = None,
        key: str | None = None,
        conn: AConn | None = None,
        priority: int | None = None,
    ) -> str:
        """Start a run; returns its id. With `key`, a second submit returns the first run's id.

        With `conn` (a psycopg AsyncConnection), the run is written in that connection's
        current transaction: it exists only if the caller commits it. `priority` (1 to 5, 1
        leased first) overrides the workflow's.
        """
        call = self._submit_call(workflow, input, run_deadline, key, priority)
        ids, fresh = await self._run(call, conn)
        if fresh is not None and conn is None:
            self._registered.add(fresh)
        return ids[0]

    async def submit_many(
        self,
        workflow: Workflow | str,
        inputs: Iterable[Any],
        *,
        run_deadline: timedelta | float | None = None,
        priority: int | None = None,
    ) -> list[str]:
        """Start one run per input in one round trip; returns the run ids in order."""
        inputs = list(inputs)
        if not inputs:
            return []
        call = self._submit_many_call(workflow, inputs, run_deadline, priority)
        ids, fresh = await self._run(call)
        if fresh is not None:
            self._registered.add(fresh)
        return ids

    # -- reading ---

    async def get_run(self, run_id: str) -> RunStatus:
        return await self._run(self._get_run_call(run_id))

    async def steps(self, run_id: str) -> list[StepInfo]:
        """Every step of the run, error text and all, in creation order."""
        return await self._run(self._steps_call(run_id))

    async def step(self, step_id: int) -> StepInfo:
        return await self._run(self._step_call(step_id))

    async def attempts(self, step_id: int) -> list[AttemptInfo]:
        """Every failed, killed or dead-lettered attempt of a step, oldest first."""
        return await self._run(self._attempts_call(step_id))  # type: ignore[no-any-return]

    async def set_rate_limit(
        self,
        name: str,
        *,
        rate: float,
        per: timedelta | float = 1.0,
        burst: float | None = None,
    ) -> None:
        """Declare limiter `name` (or change it); see Client.set_rate_limit."""
        await self._run(self._set_rate_limit_call(name, rate, per, burst))

    async def exhausted(self, query: ExhaustedQuery | None = None) -> list[StepInfo]:
        """The DLQ: dead steps, newest first."""
        return await self._run(self._exhausted_call(query))

    # -- waiting ---

    async def wait(self, run_id: str, timeout: timedelta | float | None = None) -> RunStatus:
        """The run's status once it completed, failed or was cancelled.

        TimeoutError when `timeout` (seconds or a timedelta; None: no limit) passes first.
        Any number of waits share one listening connection.
        """
        limit = timeout_seconds(timeout)
        started = time.monotonic()
        rid = run_uuid(run_id)
        if self._on_wait is not None:
            self._on_wait(rid)
        if self._closed:
            raise RuntimeError("the AsyncClient is closed")
        if self._watcher is None:
            self._watcher = AsyncWatcher(self.dsn, listen=self._listen)
        watcher = self._watcher
        future = watcher.add(rid)
        try:
            call = self._wait_start(rid, run_id, watcher.watch.register)
            status = await self._run(call)
            if status is not None:
                return status
            try:
                return await asyncio.wait_for(future, remaining(limit, started))
            except TimeoutError:
                raise TimeoutError(f"run {run_id} did not end within {limit:g}s") from None
        finally:
            watcher.discard(rid, future)

    async def result(self, run_id: str, timeout: timedelta | float | None = None) -> Any:
        """The run's output once it completed; RunFailed or RunCancelled if it did not."""
        return outcome(await self.wait(run_id, timeout))

    # -- schedules (docs/schedules.md; see Client for each) ---

    async def schedule(
        self,
        name: str,
        workflow: Workflow | str,
        *,
        cron: str | None = None,
        every: timedelta | float | None = None,
        timezone: str = "UTC",
        input: Any = None,
        overlap: str = "skip",
        catchup_window: timedelta | float = DEFAULT_CATCHUP,
        jitter: timedelta | float | None = None,
        run_deadline: timedelta | float | None = None,
    ) -> ScheduleInfo:
        """Create schedule `name` of `workflow`, or change it; see Client.schedule."""
        spec, wf = self._schedule_spec(name, workflow, {
            "cron": cron, "every": every, "timezone": timezone, "input": input,
            "overlap": overlap, "catchup_window": catchup_window, "jitter": jitter,
            "run_deadline": run_deadline,
        })  # fmt: skip
        return await self._engine(engine.save_schedule, spec, wf, now=self._clock())

    async def schedules(self) -> list[ScheduleInfo]:
        return await self._engine(engine.list_schedules)

    async def pause_schedule(self, name: str) -> None:
        await self._engine(engine.pause_schedule, self._schedule_name(name), now=self._clock())

    async def resume_schedule(self, name: str) -> None:
        await self._engine(engine.resume_schedule, self._schedule_name(name), now=self._clock())

    async def trigger_schedule(self, name: str) -> str | None:
        return await self._engine(
            engine.trigger_schedule, self._schedule_name(name), now=self._clock()
        )

    async def backfill_schedule(self, name: str, start: datetime, end: datetime) -> list[str]:
        return await self._engine(
            engine.backfill_schedule, self._schedule_name(name), start, end, now=self._clock()
        )

    async def delete_schedule(self, name: str) -> bool:
        return await self._engine(engine.delete_schedule, self._schedule_name(name))

    # -- control ---

    async def cancel(self, run_id: str) -> bool:
        return await self._engine(engine.cancel_run, run_id, now=self._clock())

    async def pause(self, run_id: str) -> bool:
        return await self._engine(engine.pause_run, run_id, now=self._clock())

    async def resume(self, run_id: str) -> bool:
        return await self._engine(engine.resume_run, run_id, now=self._clock())

    async def signal(self, run_id: str, name: str, payload: Any = None) -> bool:
        """Send a signal; it is kept until the wait for it is reached. False if the run ended."""
        return await self._engine(engine.signal_run, run_id, name, payload, now=self._clock())

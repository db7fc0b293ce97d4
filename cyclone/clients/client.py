"""The client: submit runs, control them and wait for them, from any process, by object or name.

What each call checks, sends and reads is in cyclone/clients/calls.py, shared with AsyncClient
(cyclone/clients/aclient.py); this module runs those calls on psycopg's synchronous connections.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from cyclone import engine
from cyclone.clients.calls import (
    Call,
    Calls,
    deadline_seconds,
    drive,
    outcome,
    remaining,
    run_uuid,
    timeout_seconds,
)
from cyclone.clients.waiting import ThreadWatcher
from cyclone.models import AttemptInfo, ExhaustedQuery, RunStatus, StepInfo
from cyclone.schedules import DEFAULT_CATCHUP, ScheduleInfo
from cyclone.workflow import Workflow

Conn = psycopg.Connection[Any]

__all__ = ["Client", "deadline_seconds", "submit"]


class Client(Calls):
    """Talks to Cyclone's tables. Thread-safe; connections come from a small pool.

    `wait` and `result` share one more connection, opened by the first wait, that LISTENs for
    run ends (`listen=False` skips it and polls: for a pooler that cannot deliver notifications,
    which a probe also detects).
    """

    def __init__(self, dsn: str | None = None, **options: Any) -> None:
        super().__init__(dsn, **options)
        self._pool: ConnectionPool | None = None
        self._lock = threading.Lock()
        self._watcher: ThreadWatcher | None = None

    # -- connections ---

    @contextmanager
    def connection(self, conn: Conn | None = None) -> Iterator[Conn]:
        """The caller's connection when given, else one from the pool."""
        if conn is not None:
            yield conn
            return
        with self._lock:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self.dsn,
                    min_size=1,
                    max_size=self._pool_size,
                    open=True,
                    kwargs={
                        "autocommit": True,
                        "row_factory": psycopg.rows.dict_row,
                        "fallback_application_name": "cyclone",
                        "prepare_threshold": self._prepare_threshold,
                    },
                )
        with self._pool.connection() as pooled:
            yield pooled

    def _run(self, call: Call[Any], conn: Conn | None = None) -> Any:
        """A call in one transaction of its own, or in the caller's (which decides its fate)."""
        with self.connection(conn) as c:
            if conn is not None:
                return drive(call, c)
            with c.transaction():
                return drive(call, c)

    def close(self) -> None:
        with self._lock:
            watcher, self._watcher = self._watcher, None
            pool, self._pool = self._pool, None
        if watcher is not None:
            watcher.close()
        if pool is not None:
            pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submitting ---

    def submit(
        self,
        workflow: Workflow | str,
        input: Any = None,
        *,
        run_deadline: timedelta | float | None = None,
        key: str | None = None,
        conn: Conn | None = None,
        priority: int | None = None,
    ) -> str:
        """Start a run; returns its id. With `key`, a second submit returns the first run's id.

        With `conn` (a psycopg Connection), the run is written in that connection's current
        transaction: it exists only if the caller commits it. `priority` (1 to 5, 1 leased
        first) overrides the workflow's.
        """
        call = self._submit_call(workflow, input, run_deadline, key, priority)
        ids, fresh = self._run(call, conn)
        self._remember(fresh, conn)
        return ids[0]  # type: ignore[no-any-return]

    def submit_many(
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
        ids, fresh = self._run(self._submit_many_call(workflow, inputs, run_deadline, priority))
        self._remember(fresh, None)
        return ids  # type: ignore[no-any-return]

    def _remember(self, graph_hash: str | None, conn: object) -> None:
        if graph_hash is not None and conn is None:
            self._registered.add(graph_hash)

    # -- reading ---

    def get_run(self, run_id: str) -> RunStatus:
        return self._run(self._get_run_call(run_id))  # type: ignore[no-any-return]

    def steps(self, run_id: str) -> list[StepInfo]:
        """Every step of the run, error text and all, in creation order."""
        return self._run(self._steps_call(run_id))  # type: ignore[no-any-return]

    def step(self, step_id: int) -> StepInfo:
        return self._run(self._step_call(step_id))  # type: ignore[no-any-return]

    def attempts(self, step_id: int) -> list[AttemptInfo]:
        """Every failed, killed or dead-lettered attempt of a step, oldest first: the step's
        own `error` holds only the latest, and a DLQ retry clears it."""
        return self._run(self._attempts_call(step_id))  # type: ignore[no-any-return]

    def set_rate_limit(
        self,
        name: str,
        *,
        rate: float,
        per: timedelta | float = 1.0,
        burst: float | None = None,
    ) -> None:
        """Declare limiter `name` (or change it): `rate` tokens every `per` (a timedelta or
        seconds), at most `burst` saved up (default: `rate`). Stored in PostgreSQL, shared by
        every VM; steps of nodes with `rate_limit=name` take one token per attempt."""
        self._run(self._set_rate_limit_call(name, rate, per, burst))

    def exhausted(self, query: ExhaustedQuery | None = None) -> list[StepInfo]:
        """The DLQ: dead steps, newest first."""
        return self._run(self._exhausted_call(query))  # type: ignore[no-any-return]

    # -- waiting ---

    def wait(self, run_id: str, timeout: timedelta | float | None = None) -> RunStatus:
        """The run's status once it completed, failed or was cancelled.

        TimeoutError when `timeout` (seconds or a timedelta; None: no limit) passes first.
        """
        limit = timeout_seconds(timeout)
        started = time.monotonic()
        rid = run_uuid(run_id)
        if self._on_wait is not None:
            self._on_wait(rid)
        watcher = self._waiter()
        future = watcher.add(rid)
        try:
            call = self._wait_start(rid, run_id, watcher.watch.register)
            status = self._run(call)
            if status is not None:
                return status
            try:
                return future.result(remaining(limit, started))
            except TimeoutError:
                raise TimeoutError(f"run {run_id} did not end within {limit:g}s") from None
        finally:
            watcher.discard(rid, future)

    def result(self, run_id: str, timeout: timedelta | float | None = None) -> Any:
        """The run's output once it completed; RunFailed or RunCancelled if it did not."""
        return outcome(self.wait(run_id, timeout))

    def _waiter(self) -> ThreadWatcher:
        with self._lock:
            if self._watcher is None:
                self._watcher = ThreadWatcher(self.dsn, listen=self._listen)
            return self._watcher

    # -- schedules (docs/schedules.md) ---

    def schedule(
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
        """Create schedule `name` of `workflow`, or change it: `cron` (5 fields or @daily...)
        in `timezone`, or `every` (at least 1 s). Each tick starts one run with `input`, under
        the `overlap` policy; ticks missed by more than `catchup_window` are skipped. A bad
        argument raises ConfigError naming it, and nothing is written."""
        spec, wf = self._schedule_spec(name, workflow, {
            "cron": cron, "every": every, "timezone": timezone, "input": input,
            "overlap": overlap, "catchup_window": catchup_window, "jitter": jitter,
            "run_deadline": run_deadline,
        })  # fmt: skip
        with self.connection() as c:
            return engine.save_schedule(c, spec, wf, now=self._clock())

    def schedules(self) -> list[ScheduleInfo]:
        """Every schedule, by name."""
        with self.connection() as c:
            return engine.list_schedules(c)

    def pause_schedule(self, name: str) -> None:
        """No tick starts until resumed (ScheduleNotFound if there is no such schedule)."""
        with self.connection() as c:
            engine.pause_schedule(c, self._schedule_name(name), now=self._clock())

    def resume_schedule(self, name: str) -> None:
        """Tick again from the next tick after now; ticks of the pause do not run."""
        with self.connection() as c:
            engine.resume_schedule(c, self._schedule_name(name), now=self._clock())

    def trigger_schedule(self, name: str) -> str | None:
        """One run now, under the overlap policy: its id, or None if skipped or buffered."""
        with self.connection() as c:
            return engine.trigger_schedule(c, self._schedule_name(name), now=self._clock())

    def backfill_schedule(self, name: str, start: datetime, end: datetime) -> list[str]:
        """A run for each tick in [start, end) that has none yet; the ids started."""
        with self.connection() as c:
            return engine.backfill_schedule(
                c, self._schedule_name(name), start, end, now=self._clock()
            )

    def delete_schedule(self, name: str) -> bool:
        """Delete the schedule (its runs stay); False if there was none."""
        with self.connection() as c:
            return engine.delete_schedule(c, self._schedule_name(name))

    # -- control ---

    def cancel(self, run_id: str) -> bool:
        with self.connection() as c:
            return engine.cancel_run(c, run_id, now=self._clock())

    def pause(self, run_id: str) -> bool:
        with self.connection() as c:
            return engine.pause_run(c, run_id, now=self._clock())

    def resume(self, run_id: str) -> bool:
        with self.connection() as c:
            return engine.resume_run(c, run_id, now=self._clock())

    def signal(self, run_id: str, name: str, payload: Any = None) -> bool:
        """Send a signal; it is kept until the wait for it is reached. False if the run ended."""
        with self.connection() as c:
            return engine.signal_run(c, run_id, name, payload, now=self._clock())


def submit(
    client: Client,
    workflow: Workflow | str,
    input: Any = None,
    *,
    run_deadline: timedelta | float | None = None,
    key: str | None = None,
    conn: Conn | None = None,
    priority: int | None = None,
) -> str:
    """`cyclone.submit(client, wf, input, run_deadline=...)`: the same as `client.submit`."""
    return client.submit(
        workflow, input, run_deadline=run_deadline, key=key, conn=conn, priority=priority
    )

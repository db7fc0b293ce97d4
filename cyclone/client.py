"""The client: submit runs and control them from any process, by object or by name."""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from cyclone import engine
from cyclone.db import (
    MAX_PAYLOAD_BYTES,
    callers,
    check_text,
    encode_json,
    is_step_id,
    prepare_threshold,
    resolve_dsn,
)
from cyclone.engine.graphs import current_graph, register_workflows
from cyclone.errors import RunNotFound, StepNotFound
from cyclone.models import AttemptInfo, ExhaustedQuery, RunStatus, StepInfo
from cyclone.sql import QUERIES
from cyclone.states import MAX_DEADLINE_SECONDS
from cyclone.workflow import Graph, Workflow

Conn = psycopg.Connection[Any]
Clock = Callable[[], datetime | None]


def deadline_seconds(run_deadline: timedelta | float | int | None) -> float:
    """Seconds of a run deadline; 0 means none (None, zero and negative all mean none)."""
    if run_deadline is None:
        return 0.0
    if isinstance(run_deadline, bool) or not isinstance(run_deadline, timedelta | int | float):
        raise TypeError(f"run_deadline: expected a timedelta or seconds, got {run_deadline!r}")
    secs = (
        run_deadline.total_seconds() if isinstance(run_deadline, timedelta) else float(run_deadline)
    )
    if math.isnan(secs) or secs > MAX_DEADLINE_SECONDS:
        raise ValueError(f"run_deadline: {run_deadline!r} is not a usable duration (max 100 years)")
    return secs if secs > 0 else 0.0


class Client:
    """Talks to Cyclone's tables. Thread-safe; connections come from a small pool."""

    def __init__(
        self,
        dsn: str | None = None,
        *,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        pool_size: int = 4,
        prepared_statements: bool | None = None,
        _clock: Clock | None = None,
        _on_workflow: Callable[[Workflow], None] | None = None,
    ) -> None:
        self.dsn = resolve_dsn(dsn)
        self.max_payload_bytes = max_payload_bytes
        self._pool_size = pool_size
        # None: as cyclone.db.use_prepared_statements set it for the process (on by default).
        # False behind a transaction-mode pooler, as `[database] prepared_statements` says.
        self._prepare_threshold = (
            prepare_threshold()
            if prepared_statements is None
            else 5
            if prepared_statements
            else None
        )
        self._pool: ConnectionPool | None = None
        self._lock = threading.Lock()
        self._registered: set[str] = set()
        self._clock: Clock = _clock or (lambda: None)
        # The test harness learns which workflows' code to run from what is submitted.
        self._on_workflow = _on_workflow

    @classmethod
    def from_config(cls, path: str) -> Client:
        from cyclone.config import load_config

        database = load_config(path).database
        return cls(database.url, prepared_statements=database.prepared_statements)

    # -- connections ---

    @contextmanager
    def connection(self, conn: Conn | None = None) -> Iterator[Conn]:
        """The caller's connection when given, else one from the pool."""
        if conn is not None:
            yield callers(conn)  # type: ignore[misc]
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

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

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
    ) -> str:
        """Start a run; returns its id. With `key`, a second submit returns the first run's id."""
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"key: expected a non-empty string, got {key!r}")
        if key is not None:
            check_text(key, "key")
        text = encode_json(input, "input", self.max_payload_bytes)
        deadline = deadline_seconds(run_deadline)
        with self.connection(conn) as c, c.transaction():
            graph = self._graph(c, workflow)
            run_id = str(uuid.uuid4())
            inserted = engine.submit_runs(
                c,
                graph.workflow,
                graph.hash,
                [run_id],
                [text],
                _roots(graph),
                deadline=deadline,
                key=key,
                now=self._clock(),
            )
            if inserted:
                return inserted[0]
            row = c.execute(QUERIES["run_by_key"], {"key": key}).fetchone()
            return str(row["id"])

    def submit_many(
        self,
        workflow: Workflow | str,
        inputs: Iterable[Any],
        *,
        run_deadline: timedelta | float | None = None,
    ) -> list[str]:
        """Start one run per input in one round trip; returns the run ids in order."""
        texts = [
            encode_json(inp, f"inputs[{i}]", self.max_payload_bytes) for i, inp in enumerate(inputs)
        ]
        if not texts:
            return []
        deadline = deadline_seconds(run_deadline)
        ids = [str(uuid.uuid4()) for _ in texts]
        with self.connection() as c, c.transaction():
            graph = self._graph(c, workflow)
            engine.submit_runs(
                c,
                graph.workflow,
                graph.hash,
                ids,
                texts,
                _roots(graph),
                deadline=deadline,
                now=self._clock(),
            )
        return ids

    def _graph(self, conn: Conn, workflow: Workflow | str) -> Graph:
        if isinstance(workflow, Workflow):
            graph = workflow.graph
            if self._on_workflow is not None:
                self._on_workflow(workflow)
            if graph.hash not in self._registered:
                register_workflows(conn, [workflow])
                self._registered.add(graph.hash)
            return graph
        return current_graph(conn, workflow)

    # -- reading ---

    def get_run(self, run_id: str) -> RunStatus:
        with self.connection() as c:
            row = c.execute(QUERIES["run_get"], {"run_id": _run_uuid(run_id)}).fetchone()
        if row is None:
            raise RunNotFound(f"no run {run_id!r}")
        return RunStatus.from_row(row)

    def steps(self, run_id: str) -> list[StepInfo]:
        """Every step of the run, error text and all, in creation order."""
        rid = _run_uuid(run_id)
        with self.connection() as c:
            rows = c.execute(QUERIES["run_steps"], {"run_id": rid}).fetchall()
            if not rows and c.execute(QUERIES["run_exists"], {"run_id": rid}).fetchone() is None:
                raise RunNotFound(f"no run {run_id!r}")
        return [StepInfo.from_row(r) for r in rows]

    def step(self, step_id: int) -> StepInfo:
        # Only whole numbers name steps: int() would turn 1.5, True or non-ASCII digits into a step.
        if isinstance(step_id, str) and step_id.isascii() and step_id.strip().isdigit():
            step_id = int(step_id)
        if not is_step_id(step_id):
            raise StepNotFound(f"no step {step_id!r} (not a step id)")
        with self.connection() as c:
            row = c.execute(QUERIES["step_get"], {"step_id": step_id}).fetchone()
        if row is None:
            raise StepNotFound(f"no step {step_id!r}")
        return StepInfo.from_row(row)

    def attempts(self, step_id: int) -> list[AttemptInfo]:
        """Every failed, killed or dead-lettered attempt of a step, oldest first: the step's
        own `error` holds only the latest, and a DLQ retry clears it."""
        step = self.step(step_id)  # StepNotFound for a bad or unknown id
        with self.connection() as c:
            rows = c.execute(QUERIES["step_attempts"], {"step_id": step.id}).fetchall()
        return [AttemptInfo.from_row(r) for r in rows]

    def exhausted(self, query: ExhaustedQuery | None = None) -> list[StepInfo]:
        """The DLQ: dead steps, newest first."""
        q = query or ExhaustedQuery()
        since = q.since
        if isinstance(since, timedelta):
            with self.connection() as c:
                now = self._clock() or c.execute(QUERIES["clock_now"]).fetchone()["now"]
            since = now - since
        with self.connection() as c:
            rows = c.execute(
                QUERIES["dlq_list"],
                {
                    "reason": str(q.reason) if q.reason else None,
                    "workflow": q.workflow,
                    "since": since,
                    "limit": q.limit,
                },
            ).fetchall()
        return [StepInfo.from_row(r) for r in rows]

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


def _roots(graph: Graph) -> Sequence[Any]:
    return [graph.nodes[n] for n in graph.roots]


def _run_uuid(run_id: str) -> str:
    try:
        return str(uuid.UUID(str(run_id)))
    except ValueError:
        raise RunNotFound(f"no run {run_id!r} (not a run id)") from None


def submit(
    client: Client,
    workflow: Workflow | str,
    input: Any = None,
    *,
    run_deadline: timedelta | float | None = None,
    key: str | None = None,
    conn: Conn | None = None,
) -> str:
    """`cyclone.submit(client, wf, input, run_deadline=...)`: the same as `client.submit`."""
    return client.submit(workflow, input, run_deadline=run_deadline, key=key, conn=conn)

"""What each client call checks, sends and reads back, written once for Client and AsyncClient.

A call is a generator: it checks its arguments when made (so bad input fails before any
connection is taken), then yields the statements to run in order and receives each one's
rows; what it returns is the call's result. `drive` runs a call on a psycopg Connection,
`adrive` on an AsyncConnection: the two clients differ only in which one they use. Calls
that walk run trees in Python (cancel, signal...) are the engine's own functions instead;
AsyncClient runs those through cyclone.clients.bridge.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, LiteralString, Self, TypeVar

import psycopg
from psycopg.rows import dict_row

from cyclone.db import (
    MAX_PAYLOAD_BYTES,
    check_dsn,
    check_text,
    encode_json,
    is_step_id,
    prepare_threshold,
    resolve_dsn,
)
from cyclone.engine.graphs import check_workflow_name, graph_of, registration
from cyclone.engine.runs import submit_params
from cyclone.errors import RunCancelled, RunFailed, RunNotFound, ScheduleNotFound, StepNotFound
from cyclone.models import AttemptInfo, ExhaustedQuery, RunStatus, StepInfo
from cyclone.schedules import ScheduleSpec, schedule_spec
from cyclone.sql import QUERIES
from cyclone.states import MAX_DEADLINE_SECONDS, RunState
from cyclone.tracecontext import current_traceparent
from cyclone.workflow import Graph, Workflow, concurrency_key

# A workflow's concurrency as a submit needs it: how to compute a run's key, and the limit.
Limit = tuple[str | Callable[[Any], Any], int]

T = TypeVar("T")
Clock = Callable[[], datetime | None]

# The longest idempotency key, in UTF-8 bytes: well inside a b-tree index entry (~2.7 kB).
MAX_KEY_BYTES = 1024


@dataclass(frozen=True, slots=True)
class Statement:
    name: LiteralString
    params: Mapping[str, Any] | None = None
    fetch: Literal["one", "all"] = "all"

    @property
    def query(self) -> LiteralString:
        return QUERIES[self.name]


Call = Generator[Statement, Any, T]


def drive(call: Call[T], conn: psycopg.Connection[Any]) -> T:
    """Run a call's statements on a psycopg connection; returns the call's result."""
    cur = conn.cursor(row_factory=dict_row)
    try:
        stmt = next(call)
        while True:
            cur.execute(stmt.query, stmt.params)
            if cur.description is None:  # no rows to read (an insert without RETURNING)
                stmt = call.send(None)
            else:
                stmt = call.send(cur.fetchone() if stmt.fetch == "one" else cur.fetchall())
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        cur.close()


async def adrive(call: Call[T], conn: psycopg.AsyncConnection[Any]) -> T:
    """Run a call's statements on a psycopg AsyncConnection; returns the call's result."""
    cur = conn.cursor(row_factory=dict_row)
    try:
        stmt = next(call)
        while True:
            await cur.execute(stmt.query, stmt.params)
            if cur.description is None:
                stmt = call.send(None)
            else:
                rows = await cur.fetchone() if stmt.fetch == "one" else await cur.fetchall()
                stmt = call.send(rows)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        await cur.close()


# -- checks ---


def deadline_seconds(run_deadline: timedelta | float | int | None) -> float:
    """Seconds of a run deadline; 0 means none (None or zero). A negative one is an error:
    every run is bounded, and a deadline that reads as none would fail open."""
    if run_deadline is None:
        return 0.0
    if isinstance(run_deadline, bool) or not isinstance(run_deadline, timedelta | int | float):
        raise TypeError(f"run_deadline: expected a timedelta or seconds, got {run_deadline!r}")
    secs = (
        run_deadline.total_seconds() if isinstance(run_deadline, timedelta) else float(run_deadline)
    )
    if secs < 0:
        raise ValueError(f"run_deadline: must not be negative, got {run_deadline!r} (0: none)")
    if math.isnan(secs) or secs > MAX_DEADLINE_SECONDS:
        raise ValueError(f"run_deadline: {run_deadline!r} is not a usable duration (max 100 years)")
    return secs


def check_priority(priority: int | None) -> None:
    """A submit's priority: None (the workflow's) or an integer from 1 (leased first) to 5."""
    if priority is None:
        return
    if isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= 5:
        raise ValueError(f"priority: expected an integer from 1 (first) to 5, got {priority!r}")


def timeout_seconds(timeout: timedelta | float | int | None) -> float | None:
    """Seconds a wait may take (None: no limit; zero or less: look once)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, timedelta | int | float):
        raise TypeError(f"timeout: expected a timedelta or seconds, got {timeout!r}")
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if math.isnan(secs):
        raise ValueError("timeout: NaN is not a duration")
    if secs > MAX_DEADLINE_SECONDS:  # infinity included: a wait timer cannot hold it
        raise ValueError(f"timeout: {timeout!r} is not a usable duration (None: no limit)")
    return max(secs, 0.0)


def run_uuid(run_id: str) -> str:
    try:
        return str(uuid.UUID(str(run_id)))
    except ValueError:
        raise RunNotFound(f"no run {run_id!r} (not a run id)") from None


def remaining(limit: float | None, started: float) -> float | None:
    """What is left of a wait of `limit` seconds that started at monotonic time `started`."""
    return None if limit is None else max(0.0, limit - (time.monotonic() - started))


def outcome(status: RunStatus) -> Any:
    """What `result` gives for a run that ended: its output, else RunFailed or RunCancelled."""
    if status.state == RunState.COMPLETED:
        return status.output
    if status.state == RunState.CANCELLED:
        raise RunCancelled(status.id)
    raise RunFailed(status.id, status.error_kind, status.error)


# -- calls ---


class Calls:
    """The settings the calls read, and the calls themselves; both clients inherit this.

    `dsn` (None: CYCLONE_DATABASE_URL, else the embedded server); `max_payload_bytes` bounds
    inputs; `pool_size` connections at most, plus one that LISTENs for run ends once a wait
    started (`listen=False`: waits poll instead).
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        pool_size: int = 4,
        listen: bool = True,
        prepared_statements: bool | None = None,
        _clock: Clock | None = None,
        _on_workflow: Callable[[Workflow], None] | None = None,
        _on_wait: Callable[[str], None] | None = None,
    ) -> None:
        self.dsn = resolve_dsn(dsn)
        # Before any pool: a URL libpq cannot read would be logged, password and all, by
        # every connection attempt the pool makes (ConfigError, one line, no password).
        check_dsn(self.dsn)
        self.max_payload_bytes = max_payload_bytes
        self._pool_size = pool_size
        # False: waits poll, without LISTEN (for a pooler that cannot deliver notifications,
        # which the listener's probe also detects).
        self._listen = listen
        # None: as cyclone.db.use_prepared_statements set it for the process (on by default).
        # False behind a transaction-mode pooler, as `[database] prepared_statements` says.
        self._prepare_threshold = (
            prepare_threshold() if prepared_statements is None else 5 if prepared_statements
            else None
        )  # fmt: skip
        self._clock: Clock = _clock or (lambda: None)
        # Graphs this client registered in a transaction of its own that committed: a submit
        # in a caller's transaction registers again, since that transaction may roll back.
        self._registered: set[str] = set()
        # The test harness learns which workflows' code to run from what is submitted.
        self._on_workflow = _on_workflow
        # The test harness runs a run to its end in-process before a wait looks at it.
        self._on_wait = _on_wait

    @classmethod
    def from_config(cls, path: str) -> Self:
        from cyclone.config import load_config

        database = load_config(path).database
        return cls(database.url, prepared_statements=database.prepared_statements)

    def _submit_call(
        self,
        workflow: Workflow | str,
        input: Any,
        run_deadline: timedelta | float | None,
        key: str | None,
        priority: int | None = None,
    ) -> Call[tuple[list[str], str | None]]:
        """Returns ([run id], hash of a graph registered on the way, if any)."""
        check_priority(priority)
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"key: expected a non-empty string, got {key!r}")
        if key is not None:
            check_text(key, "key")
            # The key is indexed: a long one failed in the database with an index row error,
            # after the whole key crossed the network.
            size = len(key.encode("utf-8", "surrogatepass"))
            if size > MAX_KEY_BYTES:
                raise ValueError(
                    f"key: {size} bytes, over the limit of {MAX_KEY_BYTES} (hash a longer one)"
                )
        if not isinstance(workflow, Workflow):
            check_workflow_name(workflow)
        text = encode_json(input, "input", self.max_payload_bytes)
        deadline = deadline_seconds(run_deadline)
        return self._insert_runs(
            workflow, [str(uuid.uuid4())], [text], deadline, key, priority, [input],
            current_traceparent(),
        )  # fmt: skip

    def _submit_many_call(
        self,
        workflow: Workflow | str,
        inputs: Iterable[Any],
        run_deadline: Any,
        priority: int | None = None,
    ) -> Call[tuple[list[str], str | None]]:
        check_priority(priority)
        if not isinstance(workflow, Workflow):
            check_workflow_name(workflow)
        inputs = list(inputs)
        texts = [
            encode_json(inp, f"inputs[{i}]", self.max_payload_bytes) for i, inp in enumerate(inputs)
        ]
        deadline = deadline_seconds(run_deadline)
        ids = [str(uuid.uuid4()) for _ in texts]
        return self._insert_runs(
            workflow, ids, texts, deadline, None, priority, inputs, current_traceparent()
        )

    def _insert_runs(
        self,
        workflow: Workflow | str,
        ids: list[str],
        texts: list[str],
        deadline: float,
        key: str | None = None,
        priority: int | None = None,
        inputs: list[Any] | None = None,
        trace_parent: str | None = None,
    ) -> Call[tuple[list[str], str | None]]:
        # `trace_parent` is read by the caller, as the call is made: this generator's body
        # runs when driven, maybe outside the span current at the call.
        graph, fresh, limit = yield from self._graph(workflow)
        ckeys = None
        if limit is not None:
            ckeys = [concurrency_key(limit[0], inp) for inp in inputs or ()]
        params = submit_params(
            graph.workflow, graph.hash, ids, texts, [graph.nodes[n] for n in graph.roots],
            deadline=deadline, key=key, now=self._clock(), priority=priority, ckeys=ckeys,
            climit=limit[1] if limit else None, trace_parent=trace_parent,
        )  # fmt: skip
        if ckeys:
            # The keys' locks first, in a statement of its own: run_submit's count of active
            # runs must see every admission that committed before the locks were granted.
            yield Statement("concurrency_lock", {"workflow": graph.workflow, "ckeys": ckeys})
        inserted = yield Statement("run_submit", params)
        if key is None or inserted:
            return ids, fresh
        row = yield Statement("run_by_key", {"key": key}, "one")  # the key's first run
        return [str(row["id"])], fresh

    def _graph(self, workflow: Workflow | str) -> Call[tuple[Graph, str | None, Limit | None]]:
        """The graph to submit, the hash of one registered on the way (if any), and the
        workflow's concurrency (how to compute a run's key, and the limit)."""
        if not isinstance(workflow, Workflow):
            row = yield Statement("workflow_get", {"workflow": workflow}, "one")
            graph = graph_of(workflow, row)
            if row["concurrency_limit"] is None:
                return graph, None, None
            if row["concurrency_field"] is None:
                raise ValueError(
                    f"workflow {workflow!r} computes its concurrency key in code: submit it "
                    "with its Workflow object, not by name"
                )
            return graph, None, (row["concurrency_field"], row["concurrency_limit"])
        graph = workflow.graph
        conc = workflow.concurrency
        limit = (conc.key, conc.limit) if conc is not None else None
        if self._on_workflow is not None:
            self._on_workflow(workflow)
        if graph.hash in self._registered:
            return graph, None, limit
        for params in registration([workflow]):
            yield Statement("graph_register", params)
            yield Statement("workflow_register", params)
        return graph, graph.hash, limit

    def _get_run_call(self, run_id: str) -> Call[RunStatus]:
        return self._get_run(run_uuid(run_id), run_id)

    def _get_run(self, rid: str, run_id: str) -> Call[RunStatus]:
        row = yield Statement("run_get", {"run_id": rid}, "one")
        if row is None:
            raise RunNotFound(f"no run {run_id!r}")
        return RunStatus.from_row(row)

    def _wait_start(self, rid: str, run_id: str, register: bool) -> Call[RunStatus | None]:
        """A waiter's first look: the run's status if it ended, else None. With `register`,
        the run is marked so that its end is notified."""
        if register and (yield Statement("run_wait_register", {"run_id": rid}, "one")):
            return None
        row = yield Statement("run_exists", {"run_id": rid}, "one")
        if row is None:
            raise RunNotFound(f"no run {run_id!r}")
        if not RunState(row["state"]).terminal:
            return None
        return (yield from self._get_run(rid, run_id))

    def _steps_call(self, run_id: str) -> Call[list[StepInfo]]:
        return self._steps(run_uuid(run_id), run_id)

    def _steps(self, rid: str, run_id: str) -> Call[list[StepInfo]]:
        rows = yield Statement("run_steps", {"run_id": rid})
        if not rows and (yield Statement("run_exists", {"run_id": rid}, "one")) is None:
            raise RunNotFound(f"no run {run_id!r}")
        return [StepInfo.from_row(r) for r in rows]

    def _step_call(self, step_id: int | str) -> Call[StepInfo]:
        # Only whole numbers name steps: int() would turn 1.5, True or non-ASCII digits into a step.
        if isinstance(step_id, str) and step_id.isascii() and step_id.strip().isdigit():
            step_id = int(step_id)
        if not is_step_id(step_id):
            raise StepNotFound(f"no step {step_id!r} (not a step id)")
        return self._step(step_id)  # type: ignore[arg-type]

    def _step(self, step_id: int) -> Call[StepInfo]:
        row = yield Statement("step_get", {"step_id": step_id}, "one")
        if row is None:
            raise StepNotFound(f"no step {step_id!r}")
        return StepInfo.from_row(row)

    def _attempts_call(self, step_id: int | str) -> Call[list[AttemptInfo]]:
        check = self._step_call(step_id)  # StepNotFound for a bad id, before any connection
        return self._attempts(check)

    def _attempts(self, check: Call[StepInfo]) -> Call[list[AttemptInfo]]:
        step = yield from check  # StepNotFound for an unknown one
        rows = yield Statement("step_attempts", {"step_id": step.id})
        return [AttemptInfo.from_row(r) for r in rows]

    def _set_rate_limit_call(
        self, name: str, rate: float, per: timedelta | float, burst: float | None
    ) -> Call[None]:
        if not isinstance(name, str) or not name or len(name) > 100:
            raise ValueError(f"name: expected 1 to 100 characters, got {name!r}")
        check_text(name, "name")
        secs = per.total_seconds() if isinstance(per, timedelta) else per
        for what, value in (("rate", rate), ("per", secs), ("burst", burst)):
            if value is None and what == "burst":
                continue
            if (
                isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or not 0 < value <= 1e9
            ):  # fmt: skip
                raise ValueError(f"{what}: expected a positive finite number, got {value!r}")
        params = {"name": name, "rate": float(rate), "per": float(secs),
                  "burst": float(burst if burst is not None else max(rate, 1.0))}  # fmt: skip
        yield Statement("rate_limit_set", params)

    def _schedule_spec(
        self, name: Any, workflow: Workflow | str, options: dict[str, Any]
    ) -> tuple[ScheduleSpec, Workflow | None]:
        """A client's schedule, checked before any connection: the spec and, given one, the
        Workflow object (whose graph the engine registers with the schedule)."""
        if isinstance(workflow, Workflow):
            wf_name, obj = workflow.name, workflow
        else:
            check_workflow_name(workflow)
            wf_name, obj = workflow, None
        encode_json(options.get("input"), "input", self.max_payload_bytes)
        spec = schedule_spec(name, wf_name, **options)
        if obj is not None and self._on_workflow is not None:
            self._on_workflow(obj)
        return spec, obj

    @staticmethod
    def _schedule_name(name: Any) -> str:
        if not isinstance(name, str) or "\x00" in name:
            raise ScheduleNotFound(f"no schedule {name!r} (not a schedule name)")
        return name

    def _exhausted_call(self, query: ExhaustedQuery | None) -> Call[list[StepInfo]]:
        q = query or ExhaustedQuery()
        if not isinstance(q, ExhaustedQuery):
            raise TypeError(f"expected an ExhaustedQuery, got {query!r}")
        return self._exhausted(q)

    def _exhausted(self, q: ExhaustedQuery) -> Call[list[StepInfo]]:
        since = q.since
        if isinstance(since, timedelta):
            now = self._clock() or (yield Statement("clock_now", None, "one"))["now"]
            since = now - since
        params = {
            "reason": str(q.reason) if q.reason else None,
            "workflow": q.workflow,
            "since": since,
            "limit": q.limit,
        }
        rows = yield Statement("dlq_list", params)
        return [StepInfo.from_row(r) for r in rows]


def ended_call(run_ids: Iterable[str]) -> Call[list[RunStatus]]:
    """Of these runs, those that ended (for the waiters' batched check)."""
    rows = yield Statement("runs_get_ended", {"run_ids": list(run_ids)})
    return [RunStatus.from_row(r) for r in rows]


def probe_call(token: str) -> Call[None]:
    """A notification on the run-end channel, to learn whether the listener hears them."""
    yield Statement("run_end_probe", {"token": token})

"""Schedules in the database: upsert, pause, resume, delete, trigger, backfill, and the sweep
that ticks them (`sweep_schedules`, an entry of SWEEPS).

Every function here is one transaction on a locked schedule row (the sweep takes due rows with
SKIP LOCKED; the others wait for the row). A tick's run is submitted in that transaction with
the idempotency key `tick_key(name, tick)`: the row lock keeps two scanners from handling a
tick at once, and the key keeps any path (a sweep, a backfill of the same range, a transaction
retried after its commit was lost) from starting a tick twice. docs/schedules.md.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from cyclone.db import retrying
from cyclone.engine.graphs import graph_of, registration
from cyclone.engine.runs import cancel_runs, submit_runs
from cyclone.errors import ConfigError, ScheduleNotFound
from cyclone.schedules import (
    MAX_BUFFERED,
    MAX_TICKS,
    Overlap,
    ScheduleInfo,
    ScheduleSpec,
    jitter_of,
    tick_key,
    ticks_after,
)
from cyclone.sql import QUERIES
from cyclone.workflow import Workflow, concurrency_key

Conn = psycopg.Connection[Any]
log = logging.getLogger("cyclone.schedules")
DEFAULT_BATCH = 500


def _clock(conn: Conn, now: datetime | None) -> datetime:
    """The time ticks are computed against: the caller's (TestEnv's) or the database's."""
    return now if now is not None else conn.execute(QUERIES["clock_now"]).fetchone()["now"]


def upsert_schedule(
    conn: Conn,
    spec: ScheduleSpec,
    workflow: Workflow | None = None,
    *,
    declared: bool = False,
    now: datetime | None = None,
) -> bool:
    """Create or change a schedule in the caller's transaction; True if it is new. Given the
    Workflow object, its graph is registered first (as a submit does). ConfigError, nothing
    written, when the workflow is not registered or its runs' concurrency key cannot be
    computed from the schedule's input."""
    if workflow is not None:
        for params in registration([workflow]):
            conn.execute(QUERIES["graph_register"], params)
            conn.execute(QUERIES["workflow_register"], params)
    wf = conn.execute(QUERIES["workflow_get"], {"workflow": spec.workflow}).fetchone()
    if wf is None:
        raise ConfigError(
            f"schedule {spec.name!r}: no workflow named {spec.workflow!r} is registered"
        )
    at = _clock(conn, now)
    tick = spec.first_tick_after(at)
    params = {
        "name": spec.name, "workflow": spec.workflow, "cron": spec.cron, "every": spec.every,
        "timezone": spec.timezone, "input": json.dumps(spec.input),
        "concurrency_key": _concurrency_key(spec, workflow, wf),
        "run_deadline": spec.run_deadline, "jitter": spec.jitter, "overlap": str(spec.overlap),
        "catchup_window": spec.catchup_window, "declared": declared, "next_tick_at": tick,
        "due_at": tick + spec.jitter_of(tick), "now": now,
    }  # fmt: skip
    return bool(conn.execute(QUERIES["schedule_upsert"], params).fetchone()["created"])


def _concurrency_key(spec: ScheduleSpec, workflow: Workflow | None, wf: Any) -> str | None:
    """The runs' concurrency key: the input is fixed, so it is computed once, here (the
    scanner that starts the runs has no workflow code to compute it with)."""
    if workflow is not None and workflow.concurrency is not None:
        how: Any = workflow.concurrency.key
    elif wf["concurrency_limit"] is not None:
        how = wf["concurrency_field"]
        if how is None:
            raise ConfigError(
                f"schedule {spec.name!r}: workflow {spec.workflow!r} computes its concurrency "
                "key in code: schedule it with its Workflow object, not by name"
            )
    else:
        return None
    try:
        return concurrency_key(how, spec.input)
    except ValueError as e:
        raise ConfigError(f"schedule {spec.name!r}: {e}") from None


def upsert_declared(
    conn: Conn, workflows: Iterable[Workflow], *, now: datetime | None = None
) -> list[str]:
    """Upsert the schedules declared in code (Workflow.schedule) for these workflows, in the
    caller's transaction; returns the names of declared schedules of these workflows that the
    code no longer declares (kept, and logged: deleting them is an operator's call)."""
    # Child workflows too: registration stores their graphs, so their schedules go with them.
    workflows = list({w.name: w for wf in workflows for w in (wf, *wf.children())}.values())
    names = set()
    for wf in workflows:
        for spec in wf.schedules:
            upsert_schedule(conn, spec, wf, declared=True, now=now)
            names.add(spec.name)
    rows = conn.execute(
        QUERIES["schedules_declared"], {"workflows": [wf.name for wf in workflows]}
    ).fetchall()
    gone = [r["name"] for r in rows if r["name"] not in names]
    for name in gone:
        log.warning(
            "schedule %r is no longer declared in code: it is kept and still ticks "
            "(cyclone schedules pause or delete it)", name,
        )  # fmt: skip
    return gone


@dataclass(slots=True)
class _Tick:
    """What one transaction did to a locked schedule row, saved by `save`."""

    row: dict[str, Any]
    now: datetime
    buffered: list[datetime] = field(default_factory=list)
    started: int = 0
    skipped: int = 0
    missed: int = 0
    run_ids: list[str] = field(default_factory=list)
    _active: bool | None = None

    def __post_init__(self) -> None:
        self.buffered = list(self.row["buffered"])

    @property
    def name(self) -> str:
        return str(self.row["name"])

    def active(self, conn: Conn) -> bool:
        """Whether the schedule's latest run is still active (read once, then tracked)."""
        if self._active is None:
            run_id = self.row["last_run_id"]
            self._active = run_id is not None and bool(
                conn.execute(QUERIES["schedule_run_active"], {"run_id": run_id}).fetchone()[
                    "active"
                ]
            )
        return self._active

    def start(self, conn: Conn, tick: datetime, *, lag: bool = True) -> str:
        """Submit the tick's run (or find the one its key already started)."""
        row = self.row
        wf = conn.execute(QUERIES["workflow_get"], {"workflow": row["workflow"]}).fetchone()
        graph = graph_of(row["workflow"], wf)
        climit = wf["concurrency_limit"]
        ckeys = [row["concurrency_key"]] if climit is not None and row["concurrency_key"] else None
        if ckeys:
            # As a client's submit: the key's lock first, so run_submit's count is exact.
            conn.execute(QUERIES["concurrency_lock"], {"workflow": graph.workflow, "ckeys": ckeys})
        key = tick_key(self.name, tick)
        ids = submit_runs(
            conn, graph.workflow, graph.hash, [str(uuid.uuid4())], [json.dumps(row["input"])],
            [graph.nodes[n] for n in graph.roots], deadline=row["run_deadline"], key=key,
            now=self.now, ckeys=ckeys, climit=climit if ckeys else None,
        )  # fmt: skip
        run_id = ids[0] if ids else str(conn.execute(QUERIES["run_by_key"], {"key": key})
                                        .fetchone()["id"])  # fmt: skip
        self.started += 1
        self.run_ids.append(run_id)
        row["last_run_id"], row["last_tick_at"] = run_id, tick
        row["last_lag"] = max(0.0, (self.now - tick).total_seconds()) if lag else 0.0
        self._active = True
        return run_id

    def offer(self, conn: Conn, tick: datetime, *, lag: bool = True) -> str | None:
        """A tick under the schedule's overlap policy: the run it started, if any."""
        policy = Overlap(self.row["overlap"])
        if policy == Overlap.ALLOW_ALL or not self.active(conn):
            return self.start(conn, tick, lag=lag)
        if policy == Overlap.CANCEL_OTHER:
            cancel_runs(conn, [self.row["last_run_id"]], self.now)
            return self.start(conn, tick, lag=lag)
        room = {Overlap.BUFFER_ONE: 1, Overlap.BUFFER_ALL: MAX_BUFFERED}.get(policy, 0)
        if len(self.buffered) < room:
            self.buffered.append(tick)
        else:
            self.skipped += 1
        return None

    def drain(self, conn: Conn) -> None:
        """A buffered tick starts once the run before it ended (one at a time)."""
        if self.buffered and not self.active(conn):
            self.start(conn, self.buffered.pop(0))

    def save(self, conn: Conn, next_tick: datetime, *, paused: bool | None = None) -> None:
        row = self.row
        due = next_tick + jitter_of(self.name, row["jitter"], next_tick)
        if self.buffered:
            # Buffered ticks wait for the active run to end, which no statement announces:
            # look again next pass (only such schedules are rechecked every pass).
            due = min(due, self.now)
        conn.execute(QUERIES["schedule_save"], {
            "name": self.name, "paused": row["paused"] if paused is None else paused,
            "next_tick_at": next_tick, "due_at": due, "buffered": self.buffered,
            "last_tick_at": row["last_tick_at"], "last_run_id": row["last_run_id"],
            "last_lag": row["last_lag"], "started": self.started, "skipped": self.skipped,
            "missed": self.missed, "now": self.now,
        })  # fmt: skip

    @property
    def changed(self) -> int:
        return self.started + self.skipped + self.missed


def _ticks(row: dict[str, Any], after: datetime) -> Any:
    return ticks_after(row["cron"], row["every"], row["timezone"], after)


def tick_schedule(conn: Conn, row: dict[str, Any], now: datetime) -> _Tick:
    """The due ticks of one locked schedule row: buffered ones first, then each tick due by
    `now` (its jitter included). A tick older than the catch-up window is missed (counted);
    the others go through the overlap policy. At most MAX_TICKS a call: a schedule far
    behind catches up over several passes."""
    t = _Tick(row, now)
    t.drain(conn)
    cutoff = now - timedelta(seconds=row["catchup_window"])
    tick = row["next_tick_at"]
    ticks = _ticks(row, tick)
    for _ in range(MAX_TICKS):
        due = tick + jitter_of(t.name, row["jitter"], tick)
        if due > now:
            break
        if due < cutoff:
            t.missed += 1
        else:
            t.offer(conn, tick)
        tick = next(ticks)
    t.save(conn, tick)
    return t


def sweep_schedules(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Start the runs of due schedule ticks (one per tick, under each schedule's overlap
    policy and catch-up window); returns the ticks handled: started, skipped or missed."""

    def tx() -> int:
        with conn.transaction():
            at = _clock(conn, now)
            rows = conn.execute(
                QUERIES["sweep_schedules"], {"batch_size": batch_size, "now": at}
            ).fetchall()
            return sum(_tick_one(conn, row, at) for row in rows)

    return retrying(tx)


def _tick_one(conn: Conn, row: dict[str, Any], now: datetime) -> int:
    """One schedule of a sweep's batch, in a savepoint: a schedule that cannot tick (its row
    edited by hand into nonsense, a run its workflow refuses) is logged and left due, and the
    others of the batch still tick. Connection and serialization errors end the batch, for
    `retrying` to run it again."""
    try:
        with conn.transaction():
            return tick_schedule(conn, row, now).changed
    except psycopg.OperationalError:
        raise
    except Exception:
        log.exception("schedule %r could not tick; it stays due", row["name"])
        return 0


def _locked(conn: Conn, name: str) -> dict[str, Any]:
    row = conn.execute(QUERIES["schedule_lock"], {"name": name}).fetchone()
    if row is None:
        raise ScheduleNotFound(f"no schedule {name!r}")
    return dict(row)


def trigger_schedule(conn: Conn, name: str, *, now: datetime | None = None) -> str | None:
    """One run now, under the overlap policy: its id, or None when the policy skipped or
    buffered it. The schedule's ticks are not moved."""
    with conn.transaction():
        row = _locked(conn, name)
        t = _Tick(row, _clock(conn, now))
        run_id = t.offer(conn, t.now, lag=False)
        t.save(conn, row["next_tick_at"])
        return run_id


def backfill_schedule(
    conn: Conn, name: str, start: datetime, end: datetime, *, now: datetime | None = None
) -> list[str]:
    """Start a run for each tick in [start, end) that has none yet (each tick's key finds a
    run already started); returns the ids of the runs started. Every tick starts, whatever
    the overlap policy: a backfill asks for exactly those runs. At most MAX_TICKS ticks."""
    if start.tzinfo is None or end.tzinfo is None:
        raise ValueError("backfill: start and end must be timezone-aware datetimes")
    if end <= start:
        raise ValueError(f"backfill: end ({end}) must be after start ({start})")
    with conn.transaction():
        row = _locked(conn, name)
        t = _Tick(row, _clock(conn, now))
        if end > t.now:
            raise ValueError(f"backfill: end ({end}) is in the future (the schedule ticks then)")
        last = (row["last_run_id"], row["last_tick_at"], row["last_lag"])
        ticks = []
        for tick in _ticks(row, start - timedelta(microseconds=1)):
            if tick >= end:
                break
            if len(ticks) == MAX_TICKS:
                raise ValueError(f"backfill: more than {MAX_TICKS} ticks in that range")
            ticks.append(tick)
        for tick in ticks:
            t.start(conn, tick, lag=False)
        # A backfill's runs are of past ticks: the schedule's latest tick stays its own.
        row["last_run_id"], row["last_tick_at"], row["last_lag"] = last
        t.save(conn, row["next_tick_at"])
        return t.run_ids


def pause_schedule(conn: Conn, name: str, *, now: datetime | None = None) -> None:
    with conn.transaction():
        if conn.execute(QUERIES["schedule_pause"], {"name": name, "now": now}).fetchone() is None:
            raise ScheduleNotFound(f"no schedule {name!r}")


def resume_schedule(conn: Conn, name: str, *, now: datetime | None = None) -> None:
    """Unpause: the next tick is the first after now (ticks that fell in the pause do not
    run, and are not counted as missed)."""
    with conn.transaction():
        row = _locked(conn, name)
        if not row["paused"]:
            return
        t = _Tick(row, _clock(conn, now))
        t.save(conn, next(_ticks(row, t.now)), paused=False)


def delete_schedule(conn: Conn, name: str) -> bool:
    """Delete a schedule (its runs stay); False if there was none."""
    with conn.transaction():
        return conn.execute(QUERIES["schedule_delete"], {"name": name}).fetchone() is not None


def get_schedule(conn: Conn, name: str) -> ScheduleInfo:
    row = conn.execute(QUERIES["schedule_get"], {"name": name}).fetchone()
    if row is None:
        raise ScheduleNotFound(f"no schedule {name!r}")
    return ScheduleInfo.from_row(row)


def list_schedules(conn: Conn, *, limit: int = 1000) -> list[ScheduleInfo]:
    rows = conn.execute(QUERIES["schedules_list"], {"limit": limit}).fetchall()
    return [ScheduleInfo.from_row(r) for r in rows]


def save_schedule(
    conn: Conn, spec: ScheduleSpec, workflow: Workflow | None = None, *,
    now: datetime | None = None,
) -> ScheduleInfo:  # fmt: skip
    """A client's create-or-change, in one transaction; the schedule as stored."""
    with conn.transaction():
        upsert_schedule(conn, spec, workflow, now=now)
        return get_schedule(conn, spec.name)

"""Presence: the supervisor tells the database who it is and what each of its workers holds.

`cyclone status` and `cyclone workers` read `cyclone_supervisors` and `cyclone_workers` from
any host. The supervisor upserts its rows from its loop every PUBLISH_INTERVAL, and sooner
(but at most every MIN_GAP) when a worker leased or finished a step. It keeps one connection
for that (up to two publishes a second, each on a new connection, cost the server a backend
start every time) and drops it on any error, so the next publish starts afresh. Children
inherit its socket but never touch it, as with the LISTEN connection (see store.py).

A publish waits while a kill could fall due before it returns (`Arbiter.next_kill_at`):
presence is a view, kills are the product. How long it could take depends on the
connection: one statement (PUBLISH_MARGIN) on the kept one, a connect as well (KILL_MARGIN)
without it. But a busy supervisor always has a kill close by (steps with a short timeout,
back to back), and waiting for a quiet moment then meant never publishing: `cyclone workers`
reported it lost, then the scanner removed it. So once MAX_SILENCE has passed since the last
publish, the next one goes out whatever kill is near, which can hold that kill up by at most
the statement's timeout (a connect's, if the connection was lost).

A clean exit deletes the rows; a supervisor that died leaves them to the scanner's
`stale_supervisors` sweep, which removes rows not seen for STALE_AFTER, except those of a
supervisor whose presence connection still holds its lock (`presence_claim`): one that is alive.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from cyclone.outage import one_line
from cyclone.sql import QUERIES
from cyclone.states import PUBLISH_INTERVAL
from cyclone.supervisor.children import Role, WorkerHandle
from cyclone.supervisor.store import KeptSession

log = logging.getLogger(__name__)

# Changes (a lease, an outcome) publish sooner, but no more often than this: at thousands of
# steps a second, one upsert per change would cost more than the steps.
MIN_GAP = 0.5
# After a failed publish (database down), the next try waits this long.
RETRY_AFTER = 5.0
# A publish connects (libpq's shortest connect_timeout is 2 s) and runs one statement (0.5 s
# statement_timeout): it starts only when no kill can fall due within this long.
KILL_MARGIN = 3.0
# The same on the kept connection: one statement (its 0.5 s statement_timeout), and some room.
PUBLISH_MARGIN = 0.75
# The longest a supervisor goes without publishing while the database answers, whatever its
# load: well inside the 10 s after which `cyclone status` calls it lost.
MAX_SILENCE = 2 * PUBLISH_INTERVAL


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What is published: the supervisor's state and one row per worker slot."""

    draining: bool
    target: int
    uptime: float
    workers: list[dict[str, Any]] = field(default_factory=list)
    workflows: list[str] | None = None  # the names its workers lease; None: not known
    graphs: list[str] | None = None  # the graph hashes they lease (engine/versions.py)

    def params(self, supervisor_id: str, host: str, pid: int) -> dict[str, Any]:
        columns = ("slot", "pid", "step_id", "run_id", "workflow", "node", "attempt", "busy_for")
        params: dict[str, Any] = {c + "s" if c != "busy_for" else c: [] for c in columns}
        for row in self.workers:
            for c in columns:
                params[c + "s" if c != "busy_for" else c].append(row[c])
        params.update(
            id=supervisor_id, host=host, pid=pid, target=self.target, uptime=self.uptime,
            state="draining" if self.draining else "running", served=self.workflows,
            graphs=self.graphs,
        )  # fmt: skip
        return params


def snapshot(
    children: Iterable[WorkerHandle],
    *,
    draining: bool,
    target: int,
    uptime: float,
    now: float,
    workflows: Iterable[str] | None = None,
    graphs: Iterable[str] | None = None,
) -> Snapshot:
    """One row per worker slot. During a reload an old and a new worker can share a slot
    number for a moment: the busy one (then the newer one) is shown."""
    by_slot: dict[int, WorkerHandle] = {}
    for handle in children:
        if handle.role is not Role.WORKER:
            continue
        other = by_slot.get(handle.number)
        if other is None or (handle.busy, handle.generation) > (other.busy, other.generation):
            by_slot[handle.number] = handle
    rows = []
    for slot, handle in sorted(by_slot.items()):
        lease = handle.lease
        rows.append({
            "slot": slot, "pid": handle.pid,
            "step_id": lease.step_id if lease else None,
            "run_id": lease.run_id if lease else None,
            "workflow": lease.workflow if lease else None,
            "node": lease.node if lease else None,
            "attempt": lease.attempt if lease else None,
            "busy_for": max(now - lease.leased_at, 0.0) if lease else None,
        })  # fmt: skip
    served = None if workflows is None else sorted(workflows)
    return Snapshot(
        draining=draining, target=target, uptime=uptime, workers=rows, workflows=served,
        graphs=None if graphs is None else list(graphs),
    )  # fmt: skip


Connect = Callable[[], psycopg.Connection[Any]]


class Presence:
    """When to publish, and the publishing itself; the loop asks `due()` and calls `publish`."""

    def __init__(self, connect: Connect, *, host: str | None = None, pid: int | None = None):
        self.connect = connect
        self.host = host or socket.gethostname()
        self.pid = pid or os.getpid()
        # Unique even when a pid is reused on the same host after a restart.
        self.id = f"{self.host}:{self.pid}:{secrets.token_hex(3)}"
        self.changed = True
        self.last_try = float("-inf")
        self.last_published = float("-inf")
        self.failed = False
        self.published = False
        self.session = KeptSession(self._connect_and_claim)

    def _connect_and_claim(self) -> psycopg.Connection[Any]:
        conn = self.connect()
        try:
            conn.execute(QUERIES["presence_claim"], {"id": self.id})
        except BaseException:
            conn.close()
            raise
        return conn

    def mark_changed(self) -> None:
        self.changed = True

    def next_at(self) -> float:
        """When a publish is next wanted, on the loop's monotonic clock."""
        if self.failed:
            return self.last_try + RETRY_AFTER
        if self.changed:
            return self.last_try + MIN_GAP
        return self.last_try + PUBLISH_INTERVAL

    def due(self, now: float, next_kill_at: float | None) -> bool:
        if now < self.next_at():
            return False
        if now - self.last_published >= MAX_SILENCE:
            return True  # liveness has a hard bound; see the module's docstring
        margin = PUBLISH_MARGIN if self.session.alive else KILL_MARGIN
        return next_kill_at is None or next_kill_at - now > margin

    def publish(self, snap: Snapshot, now: float) -> bool:
        self.last_try = now
        self.changed = False
        try:
            self.session.get().execute(
                QUERIES["presence_publish"], snap.params(self.id, self.host, self.pid)
            )
        except psycopg.Error as exc:
            self.session.close()
            if not self.failed:
                log.warning(
                    "cannot publish presence: %s", one_line(exc), extra={"action": "presence"}
                )
            self.failed = True
            return False
        if self.failed:
            log.info("presence published again", extra={"action": "presence"})
        self.failed = False
        self.published = True
        self.last_published = now
        return True

    def withdraw(self) -> None:
        """A clean exit: our rows go now, not when the scanner finds them stale."""
        try:
            if self.published:
                self.session.get().execute(QUERIES["presence_delete"], {"id": self.id})
        except psycopg.Error as exc:
            log.warning("cannot withdraw presence (the scanner will): %s", one_line(exc))
        finally:
            self.close()

    def close(self) -> None:
        """Drop the session without withdrawing (the rows stay until the scanner's sweep)."""
        self.session.close()

"""The scanner's sweeps, declared once in `SWEEPS`, in the order a pass runs them.

A sweep has one name, `x`: the label of its count on the scanner's `scanned` pipe line and
in its log lines, its statement `sweep_x` (sql/sweeps.sql) and its function `sweep_x` here,
`sweep_x(conn, *, batch_size=..., now=None) -> count`. Each function handles one batch in one
transaction and is safe to run from any number of scanners at once (the statements lock with
SKIP LOCKED and re-check state before writing; `reindex`, which changes no row and cannot run
in a transaction, takes a session advisory lock). The scanner process (`cyclone.scanner`) and
`TestEnv.scan` both run `enabled_sweeps()`: the scanner batches each one while batches come
back full and spaces out the ones with an `every`; the harness runs each once, on its clock.
Adding a sweep: its statement, its function, and its entry in `SWEEPS`.

    deadlines          running run past deadline_at    -> failed; live steps dead (`deadline`);
                                                          leases revoked + NOTIFY cyclone_revoked
    expired_leases     running step, lease expired     -> available (retry, `lease_expired`)
                                                          or dead
    max_wait           waiting step past max_wait      -> dead (`max_wait`); child run cancelled
    sleeps             waiting sleep past its wake-up  -> completed; downstream steps available
    stale_supervisors  supervisor not seen for a while -> its presence rows deleted
    schedules          schedule due (next tick)       -> the tick's run started (one per tick),
                                                          or skipped or buffered by its overlap
                                                          policy; missed past its catch-up window
    unserved           available step of a run whose   -> parked (`waiting`), out of the lease
                       graph no live VM serves            index; available again once served
    history            finished run past history_after -> moved to the partitioned history
                                                          (when `scanner.history_after` > 0)
    history_drop       history partition past retention-> archived (`scanner.archive`), dropped
    retention          finished run past retention     -> deleted (when `scanner.retention` > 0):
                                                          failed and keyed runs, which stay hot
    reindex            queue index a drained backlog   -> rebuilt (REINDEX INDEX CONCURRENTLY),
                       left bloated (catalog figures:     one a pass; a failed rebuild's
                       REINDEX_FLOOR, REINDEX_RATIO)      invalid leftover dropped first
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from cyclone.db import retrying
from cyclone.engine.advance import RunRef, fail_run, node_completed
from cyclone.engine.archive import Archive, ArchiveFailed, archiver
from cyclone.engine.graphs import graph_by_hash
from cyclone.engine.runs import cancel_runs, lock_run, notify_revoked, settle_late
from cyclone.engine.schedules import sweep_schedules
from cyclone.sql import QUERIES
from cyclone.states import DEADLINE_ERROR, STALE_AFTER, ErrorKind

Conn = psycopg.Connection[Any]
log = logging.getLogger(__name__)
DEFAULT_BATCH = 500
# What retention deletes row by row (failed and keyed runs, and all runs while history is off)
# is looked for every few seconds, and deleted while batches come back full for up to
# BUDGET seconds a pass: no fixed cap per minute that a faster engine could outrun.
RETENTION_EVERY = 5.0
# The most a pass spends in one sweep that loops while it is behind (moving, deleting): the
# sweeps after it (leases, deadlines) wait for it, so it yields, and goes on next pass.
BUDGET = 2.0
# History partitions are a span of at least a minute (cyclone_history_span): a look every
# ten seconds drops each within seconds of its end passing the retention.
HISTORY_DROP_EVERY = 10.0
# Parking reads every live run: every few seconds is enough (a parked step waits for a VM).
UNSERVED_EVERY = 2.0
# A supervisor seen this recently is live (as `cyclone status` says; supervisor/served.py).
LIVE_WITHIN = 10.0
# The reindex sweep (sweep_reindex). Its check is one read of the catalog, so every minute:
# after a backlog drains, the few indexes it left bloated are rebuilt one a pass, all within
# minutes of autovacuum's figures showing it.
REINDEX_EVERY = 60.0
# Below a MiB an index is never rebuilt: there is less than that to win, and a queue index in
# steady churn is mostly pages of entries deleted since the last VACUUM (0.30 to 0.41 MiB in
# bench/churn.py), far more than its few live entries need: the ratio alone would rebuild it
# every minute.
REINDEX_FLOOR = 1 << 20
# Bloated: more than this many times the bytes its entries take in a fresh build. One in use is
# within 1.5 times of that (leaves 70 to 90% full), and a workflow name a few times longer
# than the one measured still leaves it well under 8; an index a drained backlog left behind is
# tens of times over.
REINDEX_RATIO = 8.0
# The rebuild reads the table twice (build, then validate) within the statement_timeout of
# the scanner's session (30 s: ScannerOptions), and the next pass waits for it: an index of a
# table bigger than this is not rebuilt by the scanner (said once; rebuild it by hand).
REINDEX_MAX_TABLE = 1 << 30
# An index this process rebuilt, or failed to, is left alone for ten minutes: a queue whose
# steady churn keeps its index above the rule (a busier one than the churn bench's) costs one
# rebuild of a few MiB every ten minutes, not one a minute; a rebuild that timed out is not
# retried at once; and a second backlog in the hour is given back within minutes of the first.
REINDEX_AGAIN_AFTER = 600.0


def sweep_deadlines(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Fail running runs past their deadline; returns how many failed.

    Every live step of such a run is dead-lettered with kind `deadline` and error `run
    deadline exceeded`, waiting child nodes' child runs are cancelled in the same
    transaction, and `cyclone_revoked` is notified so that every supervisor kills the
    handlers at once.
    """

    def tx() -> int:
        with conn.transaction():
            row = conn.execute(
                QUERIES["sweep_deadlines"], {"batch_size": batch_size, "now": now}
            ).fetchone()
            if not row["run_ids"]:
                return 0
            settle_late(conn, [str(r) for r in row["run_ids"]], "dead", ErrorKind.DEADLINE,
                        DEADLINE_ERROR, now)  # fmt: skip
            # Child runs of dead-lettered child nodes are cancelled in this same transaction.
            if row["child_run_ids"]:
                cancel_runs(conn, row["child_run_ids"], now, notify=False)
            notify_revoked(conn)
            return len(row["run_ids"])

    return retrying(tx)


def sweep_expired_leases(
    conn: Conn,
    *,
    batch_size: int = DEFAULT_BATCH,
    now: datetime | None = None,
    outage_grace: float | None = None,
) -> int:
    """Reclaim leases nobody renewed; returns how many steps were reclaimed.

    The host or worker holding them is gone or stuck. The step is retried (kind
    `lease_expired`) while attempts remain, else dead-lettered. Rescue is keyed on lease
    expiry only, never on how long a step has been running: a step that is slow but alive
    keeps renewing its lease, and taking it away would run it twice at once.

    With `outage_grace` (the scanner passes lease_ttl), a lease that lapsed before the server
    had been up that long lapsed because the database itself was down (every holder's session
    failed with it): it goes back with its attempt not spent.
    """
    params = {"batch_size": batch_size, "now": now, "outage_grace": outage_grace}

    def tx() -> int:
        with conn.transaction():
            rows = conn.execute(QUERIES["sweep_expired_leases"], params).fetchall()
            for run_id in {str(r["run_id"]) for r in rows if r["state"] == "dead"}:
                fail_run(conn, run_id, now)
            if rows:
                notify_revoked(conn)
            return len(rows)

    return retrying(tx)


def sweep_max_wait(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Dead-letter waits and child nodes parked past their max_wait (kind `max_wait`), failing
    their runs and cancelling a child node's child run in the same transaction; returns how
    many runs failed (two waits of one run expiring together fail it once)."""

    def tx() -> int:
        with conn.transaction():
            rows = conn.execute(
                QUERIES["sweep_max_wait"], {"batch_size": batch_size, "now": now}
            ).fetchall()
            children = [r["child_run_id"] for r in rows if r["child_run_id"] is not None]
            if children:
                cancel_runs(conn, children, now, notify=False)
            failed = {str(r["run_id"]) for r in rows}
            for run_id in failed:
                fail_run(conn, run_id, now)
            return len(failed)

    return retrying(tx)


def sweep_sleeps(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Complete sleeps that are over and advance their runs; returns how many woke."""

    def tx() -> int:
        with conn.transaction():
            rows = conn.execute(
                QUERIES["sweep_sleeps"], {"batch_size": batch_size, "now": now}
            ).fetchall()
            for row in rows:
                run = lock_run(conn, row["run_id"])
                ref = RunRef(str(run["id"]), run["workflow"], run["graph_hash"])
                node_completed(conn, ref, graph_by_hash(conn, ref.graph_hash), row["node"], now)
            return len(rows)

    return retrying(tx)


def sweep_retention(
    conn: Conn, *, retention: float, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Delete finished top-level runs older than `retention` seconds, with their child runs
    and steps; returns how many top-level runs."""
    with conn.transaction():
        row = conn.execute(
            QUERIES["sweep_retention"],
            {"retention": retention, "batch_size": batch_size, "now": now},
        ).fetchone()
        return int(row["deleted"])


def sweep_history(
    conn: Conn,
    *,
    history_after: float,
    retention: float = 0.0,
    batch_size: int = DEFAULT_BATCH,
    now: datetime | None = None,
) -> int:
    """Move finished top-level runs (completed or cancelled, no idempotency key) that ended
    more than `history_after` seconds ago, with their child runs, steps and attempts, into the
    partitioned history, making its partitions as needed; returns how many top-level runs."""
    params = {"tail": history_after, "retention": retention, "batch_size": batch_size,
              "now": now}  # fmt: skip
    try:
        with conn.transaction():
            return int(conn.execute(QUERIES["sweep_history"], params).fetchone()["moved"])
    except psycopg.errors.LockNotAvailable:
        return 0  # a partition to make, and readers of history in the way: next pass


def history_droppable(
    conn: Conn, *, retention: float, now: datetime | None = None
) -> list[tuple[datetime, datetime]]:
    """The history partitions all past `retention`, oldest first: (lo, hi) each."""
    with conn.transaction():
        rows = conn.execute(
            QUERIES["history_droppable"], {"retention": retention, "now": now}
        ).fetchall()
    return [(r["lo"], r["hi"]) for r in rows]


def sweep_history_drop(
    conn: Conn,
    *,
    retention: float,
    batch_size: int = DEFAULT_BATCH,
    now: datetime | None = None,
    archive: Archive | None = None,
    archive_dir: str | None = None,
    archive_command: str | None = None,
    history_after: float = 0.0,
) -> int:
    """Make the partitions of the next two spans ahead (while history is on: `history_after`
    > 0), then drop the history partitions all past `retention`, oldest first, after
    `archive(conn, lo, hi)` (else the one `archive_dir` or `archive_command` names,
    cyclone.engine.archive) wrote each one out; returns how many were dropped. One that
    readers hold for over 100 ms, or whose archive failed (logged), is kept for the next
    pass."""
    archive = archive or archiver(archive_dir, archive_command)
    if history_after > 0:  # else nothing moves: partitions are only dropped
        try:
            with conn.transaction():
                conn.execute(QUERIES["history_ahead"], {"retention": retention, "now": now})
        except psycopg.errors.LockNotAvailable:
            pass  # a reader held history: the moves make what they need
    dropped = 0
    for lo, hi in history_droppable(conn, retention=retention, now=now)[:batch_size]:
        if archive is not None:
            try:
                archive(conn, lo, hi)
            except ArchiveFailed as exc:
                log.error("history_drop: %s", exc, extra={"action": "sweep"})
                break
        try:
            with conn.transaction():
                row = conn.execute(
                    QUERIES["sweep_history_drop"], {"retention": retention, "now": now, "lo": lo}
                ).fetchone()
        except psycopg.errors.LockNotAvailable:
            break
        dropped += bool(row["dropped"])
    return dropped


def sweep_stale_supervisors(
    conn: Conn,
    *,
    batch_size: int = DEFAULT_BATCH,
    now: datetime | None = None,
    stale_after: float = STALE_AFTER,
) -> int:
    """Forget supervisors that died without withdrawing their presence rows (SIGKILL, host
    lost); returns how many. Their workers' rows go with them by cascade. Their steps are not
    touched: leases a lost host held come back through lease expiry, as always."""
    params = {"now": now, "stale_after": stale_after, "batch_size": batch_size}
    with conn.transaction():
        return len(conn.execute(QUERIES["sweep_stale_supervisors"], params).fetchall())


def sweep_queued_deadlines(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Fail queued runs past their deadline (their root steps dead-lettered, kind deadline);
    returns how many failed. They hold no lease and no slot: nothing else to revoke."""
    with conn.transaction():
        row = conn.execute(
            QUERIES["sweep_queued_deadlines"], {"batch_size": batch_size, "now": now}
        ).fetchone()
        return int(row["failed"])


def sweep_held_steps(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Admit held steps of limited nodes whose slot or token is free now (tokens refill with
    time, which no statement announces); returns how many."""
    with conn.transaction():
        row = conn.execute(
            QUERIES["sweep_held_steps"], {"batch_size": batch_size, "now": now}
        ).fetchone()
        return int(row["admitted"])


def sweep_fair_clock(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Move each queue's fair clock up to the largest pass in service; returns the queues
    moved. Runs of a group with nothing queued start at that clock (docs/flow-control.md)."""
    with conn.transaction():
        return len(conn.execute(QUERIES["sweep_fair_clock"], {}).fetchall())


def sweep_unserved(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Park the available steps of runs whose graph no live supervisor serves, out of the
    lease index, and make parked steps available again once one does; returns the steps moved.
    """
    params = {"batch_size": batch_size, "now": now, "lost_after": LIVE_WITHIN}

    def tx() -> int:
        with conn.transaction():
            row = conn.execute(QUERIES["sweep_unserved"], params).fetchone()
        return int(row["parked"]) + int(row["unparked"])

    return retrying(tx)


# What one scanner process remembers between passes of the reindex sweep (as session.py's
# check, once a process): when it last rebuilt or failed to rebuild each index, by (schema,
# index), and the warnings it gave, each once.
_reindexed: dict[tuple[str, str], float] = {}
_warned: set[tuple[str, ...]] = set()


def _warn_once(key: tuple[str, ...], message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args, extra={"action": "sweep", "sweep": "reindex"})


def sweep_reindex(
    conn: Conn, *, batch_size: int = DEFAULT_BATCH, now: datetime | None = None
) -> int:
    """Rebuild one queue index that a drained backlog left bloated, with REINDEX INDEX
    CONCURRENTLY (writes go on meanwhile); returns how many were rebuilt (0 or 1).

    Bloated, from catalog figures only (sql/sweeps.sql, sweep_reindex): at least REINDEX_FLOOR
    bytes, and more than REINDEX_RATIO times what its entries take in a fresh build. First the
    invalid leftovers of a rebuild that failed (`<index>_ccnew`, `_ccold`) are dropped. Under
    a session advisory lock, so that two scanners never rebuild at once; not behind a pooler
    (that lock, a session's, would stay on whichever server connection it landed), nor in a
    transaction (the statements refuse to run in one), nor under a role that does not own the
    tables (said once). A failure is logged and never fails the pass."""
    if not conn.autocommit or conn.info.transaction_status != TransactionStatus.IDLE:
        return 0
    params = {"floor": REINDEX_FLOOR, "ratio": REINDEX_RATIO}
    rows = conn.execute(QUERIES["sweep_reindex"], params).fetchall()
    if not rows:
        return 0
    schema = rows[0]["schema"]
    if rows[0]["pid"] != conn.info.backend_pid:
        _warn_once(
            (schema, "pooled"),
            "reindex: the scanner's session is not the server's (a pooler's): bloated queue "
            "indexes are not rebuilt here; %s",
            _by_hand(rows[0]),
        )
        return 0
    if not conn.execute(QUERIES["reindex_lock"]).fetchone()["locked"]:
        return 0  # another scanner is at it
    try:
        return _reindex_one(conn, schema, rows)
    finally:
        if not conn.broken:
            conn.execute(QUERIES["reindex_unlock"])


def _reindex_one(conn: Conn, schema: str, rows: list[dict[str, Any]]) -> int:
    for row in rows:
        index = row["index"]
        if not row["may"]:
            _warn_once(
                (schema, "may"),
                "reindex: role %s may not rebuild or drop the indexes "
                "of %s (REINDEX needs the table's owner, or MAINTAIN on PostgreSQL 17): "
                "bloated queue indexes are left as they are; %s",
                row["user"],
                row["table"],
                _by_hand(row),
            )
            continue
        if row["leftover"]:
            if not _reindex_statement(conn, "reindex_drop", schema, index):
                return 0
            log.info("reindex: dropped %s, left invalid by a rebuild that failed", index,
                     extra={"action": "sweep", "sweep": "reindex"})  # fmt: skip
            continue
        if time.monotonic() - _reindexed.get((schema, index), float("-inf")) < REINDEX_AGAIN_AFTER:
            continue
        if row["table_bytes"] > REINDEX_MAX_TABLE:
            _warn_once(
                (schema, index),
                "reindex: %s is bloated (%d bytes for %d entries) but its table holds %d "
                "bytes, more than the scanner rebuilds within its statement_timeout; %s",
                index,
                row["bytes"],
                row["entries"],
                row["table_bytes"],
                _by_hand(row),
            )
            continue
        _reindexed[(schema, index)] = time.monotonic()  # a failure too: not again at once
        if not _reindex_statement(conn, "reindex_index", schema, index):
            return 0
        after = conn.execute(QUERIES["reindex_size"], {"schema": schema, "index": index})
        log.info("reindex: rebuilt %s: %d bytes before, %d after (%d entries)", index,
                 row["bytes"], after.fetchone()["bytes"], row["entries"],
                 extra={"action": "sweep", "sweep": "reindex"})  # fmt: skip
        return 1
    return 0


def _reindex_statement(conn: Conn, name: str, schema: str, index: str) -> bool:
    """Rebuild or drop `index`; False when that failed (a timeout, a lock, a right missing:
    logged), which the pass survives. The invalid index a failed rebuild leaves is dropped at
    the next check, and that index is tried again REINDEX_AGAIN_AFTER later."""
    statement = sql.SQL(QUERIES[name]).format(index=sql.Identifier(schema, index))
    try:
        conn.execute(statement, prepare=False)
    except psycopg.Error as exc:
        if conn.broken:
            raise  # the database went away: the scanner's outage handling
        what = "rebuilding" if name == "reindex_index" else "dropping"
        log.warning("reindex: %s %s failed: %s", what, index, str(exc).strip(),
                    extra={"action": "sweep", "sweep": "reindex"})  # fmt: skip
        return False
    return True


def _by_hand(row: Mapping[str, Any]) -> str:
    what = "DROP INDEX CONCURRENTLY" if row["leftover"] else "REINDEX INDEX CONCURRENTLY"
    return f"by hand: {what} {row['schema']}.{row['index']}"


@dataclass(frozen=True, slots=True)
class Sweep:
    """One entry of `SWEEPS`: everything the scanner and the harness need to run a sweep."""

    name: str
    run: Callable[..., int]  # sweep_<name>: one batch, one transaction; rows changed
    every: float | None = None  # at most this often (seconds); None: every pass
    runs_failed: ErrorKind | None = None  # its rows are runs failed, for this reason
    leases_reclaimed: bool = False  # its rows are expired leases reclaimed
    setting: str | None = None  # a scanner setting it takes; off while that is 0 or less
    takes: tuple[str, ...] = ()  # scanner settings passed to it when given, whatever they are
    # Acts on a time (cyclone_next_due): also run when the scanner wakes for one, between its
    # passes (migration 22).
    timely: bool = False
    # What its count means, for the scanner's log line: "woke {n} sleeping step(s)".
    said: str = ""

    def describe(self, n: int) -> str:
        return self.said.format(n=n) if self.said else f"{self.name}: {n}"

    # Seconds a pass may spend batching it while batches come back full (None: the scanner's
    # MAX_BATCHES, with pauses between them for the rows' other users).
    budget: float | None = None
    # The most batches a pass runs, full or not (None: as above).
    batches: int | None = None
    # It logs what it did itself, in more words than a count (reindex: the index, its bytes
    # before and after): no line from the scanner.
    logs_itself: bool = False

    def batch(
        self,
        conn: Conn,
        *,
        batch_size: int = DEFAULT_BATCH,
        now: datetime | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> int:
        """One batch: `run` with the setting it takes, if any."""
        extra = {self.setting: (settings or {})[self.setting]} if self.setting else {}
        extra.update({k: (settings or {})[k] for k in self.takes if k in (settings or {})})
        return self.run(conn, batch_size=batch_size, now=now, **extra)

    def enabled(self, settings: Mapping[str, Any] | None = None) -> bool:
        return self.setting is None or (settings or {}).get(self.setting, 0) > 0


# Deadlines first: a run past its deadline must fail before anything else touches it.
# `runs_failed` and `leases_reclaimed` say which metrics the supervisor feeds with a count
# (cyclone_scanner_runs_failed_total{reason}, cyclone_lease_expirations_total).
SWEEPS = (
    Sweep("deadlines", sweep_deadlines, runs_failed=ErrorKind.DEADLINE, timely=True,
          said="failed {n} run(s) past their deadline"),
    Sweep("queued_deadlines", sweep_queued_deadlines, runs_failed=ErrorKind.DEADLINE,
          timely=True, said="failed {n} queued run(s) past their deadline"),
    Sweep("expired_leases", sweep_expired_leases, leases_reclaimed=True, takes=("outage_grace",),
          said="reclaimed {n} expired lease(s)"),
    Sweep("max_wait", sweep_max_wait, runs_failed=ErrorKind.MAX_WAIT, timely=True,
          said="failed {n} run(s) waiting past max_wait"),
    Sweep("sleeps", sweep_sleeps, timely=True, said="woke {n} sleeping step(s)"),
    # Stale rows only matter to a human reading `cyclone status`: no hurry.
    Sweep("stale_supervisors", sweep_stale_supervisors, every=STALE_AFTER / 2,
          said="removed {n} supervisor(s) not seen for a while"),
    # Woken at a rate bucket's next_at (migration 29), as for the other times.
    Sweep("held_steps", sweep_held_steps, timely=True, said="admitted {n} held step(s)"),
    # A version no live VM serves: its steps wait parked (docs/deploys.md); back within
    # UNSERVED_EVERY of a VM that serves it publishing its presence.
    Sweep("unserved", sweep_unserved, every=UNSERVED_EVERY,
          said="parked or freed {n} step(s) of versions no VM serves"),
    Sweep("fair_clock", sweep_fair_clock, said="moved {n} queue clock(s)"),
    # Ticks start runs: after the sweeps that end runs, so an overlap policy sees them ended.
    Sweep("schedules", sweep_schedules, timely=True, said="handled {n} schedule tick(s)"),
    # Ended runs leave after everything that ends runs, so a pass moves what it just ended.
    Sweep("history", sweep_history, setting="history_after", takes=("retention",), budget=BUDGET,
          said="moved {n} finished run(s) to the history"),
    Sweep("history_drop", sweep_history_drop, every=HISTORY_DROP_EVERY, setting="retention",
          takes=("archive_dir", "archive_command", "history_after"),
          said="dropped {n} history partition(s) past retention"),
    Sweep("retention", sweep_retention, every=RETENTION_EVERY, setting="retention",
          budget=BUDGET, said="deleted {n} finished run(s) past retention"),
    # Last: what the sweeps before it deleted is what it gives back. One index a pass at most.
    Sweep("reindex", sweep_reindex, every=REINDEX_EVERY, batches=1, logs_itself=True,
          said="rebuilt {n} bloated queue index(es)"),
)  # fmt: skip


def enabled_sweeps(settings: Mapping[str, Any] | None = None) -> list[Sweep]:
    """The sweeps a pass runs, in order, given the scanner's settings (`retention`)."""
    return [s for s in SWEEPS if s.enabled(settings)]

"""One read of everything `cyclone status` shows, taken from the database on its clock.

The same `Snapshot` feeds the live screen, the one-shot print and `--json`, so the three never
disagree. Every query is bounded (LIMIT) and index-backed (see sql/status.sql).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import psycopg

from cyclone.sanitize import printable
from cyclone.sql import QUERIES

# JSON consumers check this before reading; bump it when a key changes meaning or goes away.
SCHEMA_VERSION = 1
# A supervisor refreshes its row every 2 s; one not seen for this long is lost (its
# host died, or it was killed without cleaning up).
LOST_AFTER = 10.0
# Finished runs are counted over this window, so the cost follows recent work, not history.
FINISHED_WINDOW = 3600.0
MAX_SUPERVISORS = 200
MAX_WORKERS = 2000
MAX_ROWS = 10
# Due steps are counted up to this many; `queue["due_capped"]` says the backlog is bigger.
MAX_DUE_COUNT = 10_000


@dataclass(frozen=True, slots=True)
class Snapshot:
    taken_at: datetime
    supervisors: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    runs_live: dict[str, int]
    runs_finished: dict[str, int]
    finished_window_seconds: float
    queue: dict[str, Any]
    dlq: list[dict[str, Any]]
    deadline_failures: list[dict[str, Any]]
    paused: list[dict[str, Any]]
    paused_total: int
    version: int = SCHEMA_VERSION
    # Running runs of workflows no live supervisor serves, by workflow (most runs first).
    unserved: list[dict[str, Any]] = field(default_factory=list)
    # The next ticks of unpaused schedules, soonest first (docs/schedules.md).
    schedules: list[dict[str, Any]] = field(default_factory=list)
    # Read from a replica ([database] read_url): how far its replay is behind (seconds; 0
    # when it has replayed all it received). None: read from the primary.
    replica_lag: float | None = None

    @property
    def dlq_total(self) -> int:
        return sum(r["steps"] for r in self.dlq)


def take_snapshot(
    conn: psycopg.Connection[Any], *, rows: int = MAX_ROWS, presence_only: bool = False
) -> Snapshot:
    """Read the status in one repeatable-read transaction, so the sections agree.

    Every query is sent before the first answer is read (pipeline mode): one round trip, not
    one per section, for a screen that refreshes every second. `presence_only` reads just the
    supervisors and workers (for `cyclone workers`).
    """
    queries: dict[str, dict[str, Any]] = {
        "status_begin": {},
        "clock_now": {},
        "replica_lag": {},
        "status_supervisors": {"limit": MAX_SUPERVISORS},
        "status_workers": {"limit": MAX_WORKERS},
    }
    if not presence_only:
        queries |= {
            "status_runs_by_state": {"window": FINISHED_WINDOW},
            "status_queue": {"cap": MAX_DUE_COUNT},
            "status_dlq_depth": {},
            "status_deadline_failures": {"limit": rows},
            "status_paused_runs": {"limit": rows},
            "status_unserved": {
                "limit": rows, "served": [], "graphs": None, "self_id": None,
                "lost_after": LOST_AFTER,
            },
            "status_schedules": {"limit": rows},
        }  # fmt: skip
    with conn.transaction(), conn.pipeline():
        cursors = {name: conn.execute(QUERIES[name], params) for name, params in queries.items()}
        got = {
            name: [dict(r) for r in cur.fetchall()]
            for name, cur in cursors.items()
            if name != "status_begin"
        }
    supervisors = got["status_supervisors"]
    for sup in supervisors:
        sup["lost"] = sup["seen_ago"] > LOST_AFTER
    live: dict[str, int] = {"running": 0, "paused": 0}
    finished: dict[str, int] = {"completed": 0, "failed": 0, "cancelled": 0}
    for r in got.get("status_runs_by_state", []):
        (finished if r["recent"] else live)[r["state"]] = r["runs"]
    queue = got.get("status_queue", [{"due": 0, "due_capped": False}])[0]
    paused = got.get("status_paused_runs", [])
    return Snapshot(
        taken_at=got["clock_now"][0]["now"],
        supervisors=supervisors,
        workers=got["status_workers"],
        runs_live=live,
        runs_finished=finished,
        finished_window_seconds=FINISHED_WINDOW,
        queue=queue,
        dlq=got.get("status_dlq_depth", []),
        deadline_failures=got.get("status_deadline_failures", []),
        paused=[{k: v for k, v in p.items() if k != "total"} for p in paused],
        paused_total=paused[0]["total"] if paused else 0,
        unserved=got.get("status_unserved", []),
        schedules=got.get("status_schedules", []),
        replica_lag=got["replica_lag"][0]["lag"],
    )


def for_display(snap: Snapshot) -> Snapshot:
    """The snapshot with every text one printable line (workflow and node names, hosts and
    errors come from users: a newline or an escape sequence must not reach the screen). The
    JSON output keeps the values as they are."""
    return replace(
        snap, supervisors=_clean(snap.supervisors), workers=_clean(snap.workers),
        queue=_clean(snap.queue), dlq=_clean(snap.dlq),
        deadline_failures=_clean(snap.deadline_failures), paused=_clean(snap.paused),
        unserved=_clean(snap.unserved), schedules=_clean(snap.schedules),
    )  # fmt: skip


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value

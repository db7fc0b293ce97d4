"""States and error kinds, stored as text and mirrored by CHECK constraints in the schema."""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    QUEUED = "queued"  # waiting for a concurrency slot of its key (flow control)
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_RUN_STATES


class StepState(StrEnum):
    AVAILABLE = "available"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    DEAD = "dead"
    DISCARDED = "discarded"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STEP_STATES


class ErrorKind(StrEnum):
    ERROR = "error"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    LEASE_EXPIRED = "lease_expired"
    DEADLINE = "deadline"
    MAX_WAIT = "max_wait"
    CHILD_FAILED = "child_failed"
    CANCELLED = "cancelled"
    TOO_MANY_ITEMS = "too_many_items"

    @property
    def retried(self) -> bool:
        return self in RETRIED_KINDS


class NodeKind(StrEnum):
    TASK = "task"
    MAP = "map"
    WAIT = "wait"
    SLEEP = "sleep"
    CHILD = "child"

    @property
    def first_state(self) -> StepState:
        """The state a step of this kind starts in, and comes back to on a DLQ retry: waits
        and sleeps wait for their signal or their time, the others are available to a worker.
        The statements that make steps use the SQL function cyclone_kind_first_state
        (migration 11), which says the same (a test holds them equal)."""
        return StepState.WAITING if self in (NodeKind.WAIT, NodeKind.SLEEP) else StepState.AVAILABLE


TERMINAL_RUN_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED})
TERMINAL_STEP_STATES = frozenset({StepState.COMPLETED, StepState.DEAD, StepState.DISCARDED})
LIVE_STEP_STATES = frozenset({StepState.AVAILABLE, StepState.RUNNING, StepState.WAITING})
RETRIED_KINDS = frozenset(
    {ErrorKind.ERROR, ErrorKind.TIMEOUT, ErrorKind.CRASHED, ErrorKind.LEASE_EXPIRED}
)
# The kinds a dead step may have (the DLQ's reasons): a cancelled run's steps are discarded,
# never dead, so `cancelled` is none of them.
DEAD_KINDS = tuple(kind for kind in ErrorKind if kind is not ErrorKind.CANCELLED)

# The exact text docs/run-deadlines.md promises for steps killed by a run deadline.
DEADLINE_ERROR = "run deadline exceeded"
# The longest run deadline accepted (submit, dlq retry): far beyond any real run, and far
# inside what a PostgreSQL interval can hold.
MAX_DEADLINE_SECONDS = 100 * 365 * 86400
# A supervisor publishes its presence rows this often; the scanner deletes those not seen for
# STALE_AFTER. Both sides read them here.
# The longest a supervisor or scanner that set the wake flag (or its timer) waits for the
# transactions then in progress to end before it looks again (cyclone_wake_settle, migration 22).
WAKE_SETTLE = 0.2
PUBLISH_INTERVAL = 2.0
STALE_AFTER = 10 * PUBLISH_INTERVAL

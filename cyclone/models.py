"""Frozen rows returned by the client."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from cyclone.states import DEAD_KINDS, ErrorKind, NodeKind, RunState, StepState


@dataclass(frozen=True, slots=True)
class RunStatus:
    id: str
    workflow: str
    state: RunState
    input: Any
    output: Any
    error_kind: ErrorKind | None
    error: str | None
    parent_run_id: str | None
    created_at: datetime
    deadline_at: datetime | None
    paused_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> RunStatus:
        state = RunState(row["state"])
        failure = row.get("failure") or {}
        kind, error = failure.get("error_kind"), failure.get("error")
        if state == RunState.CANCELLED:
            kind, error = ErrorKind.CANCELLED, "run cancelled"
        elif state != RunState.FAILED:
            kind, error = None, None
        return cls(
            id=str(row["id"]),
            workflow=row["workflow"],
            state=state,
            input=row["input"],
            output=row["output"],
            error_kind=ErrorKind(kind) if kind else None,
            error=error,
            parent_run_id=str(row["parent_run_id"]) if row["parent_run_id"] else None,
            created_at=row["created_at"],
            deadline_at=row["deadline_at"],
            paused_at=row["paused_at"],
            finished_at=row["finished_at"],
        )


def node_label(node: str, item_index: int | None) -> str:
    return node if item_index is None else f"{node}[{item_index}]"


@dataclass(frozen=True, slots=True)
class StepInfo:
    id: int
    run_id: str
    workflow: str
    node: str
    kind: NodeKind
    state: StepState
    attempt: int
    error: str | None
    error_kind: ErrorKind | None
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    item_index: int | None = None

    @property
    def label(self) -> str:
        """The node, with a map item's index: `notify[3]`."""
        return node_label(self.node, self.item_index)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> StepInfo:
        return cls(
            id=row["id"],
            run_id=str(row["run_id"]),
            workflow=row["workflow"],
            node=row["node"],
            kind=NodeKind(row["kind"]),
            state=StepState(row["state"]),
            attempt=row["attempt"],
            error=row["error"],
            error_kind=ErrorKind(row["error_kind"]) if row["error_kind"] else None,
            created_at=row["created_at"],
            started_at=row["started_at"],
            completed_at=row["completed_at"],
            item_index=row.get("item_index"),
        )


@dataclass(frozen=True, slots=True)
class AttemptInfo:
    """One failed, killed or dead-lettered attempt of a step (`Client.attempts`)."""

    attempt: int
    error_kind: ErrorKind
    error: str | None
    worker: str | None
    started_at: datetime | None
    ended_at: datetime

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> AttemptInfo:
        return cls(
            attempt=row["attempt"],
            error_kind=ErrorKind(row["error_kind"]),
            error=row["error"],
            worker=row["worker"],
            started_at=row["started_at"],
            ended_at=row["ended_at"],
        )


@dataclass(frozen=True, slots=True)
class ExhaustedQuery:
    """A DLQ filter: dead steps by error kind, workflow and age."""

    reason: ErrorKind | str | None = None
    workflow: str | None = None
    since: timedelta | datetime | None = None
    limit: int = 1000

    def __post_init__(self) -> None:
        if self.reason is not None:
            kinds = ", ".join(k.value for k in DEAD_KINDS)
            try:
                object.__setattr__(self, "reason", ErrorKind(self.reason))
            except ValueError:
                raise ValueError(f"unknown error kind {self.reason!r} (one of: {kinds})") from None
            if self.reason not in DEAD_KINDS:
                raise ValueError(
                    f"no dead step has error kind {self.reason!r}: a cancelled run's steps are "
                    f"discarded, not dead-lettered (one of: {kinds})"
                )
        if self.since is not None and not isinstance(self.since, timedelta | datetime):
            raise TypeError(f"since: expected a timedelta or a datetime, got {self.since!r}")
        if self.workflow is not None and not isinstance(self.workflow, str):
            raise TypeError(f"workflow: expected a workflow name, got {self.workflow!r}")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise ValueError(f"limit must be a positive integer, got {self.limit!r}")

"""What a handler sees: `StepContext`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any


class CancelEvent(threading.Event):
    """A threading.Event that can also cancel an asyncio task when it is set."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def add_callback(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def set(self) -> None:
        with self._lock:
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


class StepContext:
    """The step being run: ids, the run's input, upstream results, and the time it has left.

    `done` is set when the step is cancelled (timeout, cancel, run deadline, shutdown): a
    cooperative handler checks it and stops. One that does not is killed anyway.
    """

    __slots__ = (
        "_deadline_left",
        "_loader",
        "_results",
        "_started",
        "attempt",
        "deadline",
        "done",
        "input",
        "item",
        "node",
        "run_id",
        "step_id",
        "workflow",
    )

    def __init__(
        self,
        *,
        run_id: str,
        step_id: int,
        workflow: str,
        node: str,
        attempt: int,
        input: Any,
        item: Any = None,
        deadline: datetime | None = None,
        deadline_left: float | None = None,
        done: threading.Event | None = None,
        results: Callable[[], Mapping[str, Any]] | Mapping[str, Any] | None = None,
    ) -> None:
        self.run_id = run_id
        self.step_id = step_id
        self.workflow = workflow
        self.node = node
        self.attempt = attempt
        self.input = input
        self.item = item
        self.deadline = deadline
        self.done = done if done is not None else CancelEvent()
        self._deadline_left = deadline_left
        self._started = time.monotonic()
        self._loader = results if callable(results) else None
        self._results = None if callable(results) else dict(results or {})

    @property
    def results(self) -> Mapping[str, Any]:
        """Outputs of the run's completed nodes, by name (a map's: its items' outputs, in order).

        Read from the database on first use, so handlers that never look pay nothing.
        """
        if self._results is None:
            self._results = dict(self._loader()) if self._loader else {}
        return self._results

    def time_left(self) -> timedelta | None:
        """Time until the run's deadline (never negative), or None when it has none."""
        if self._deadline_left is None:
            return None
        left = self._deadline_left - (time.monotonic() - self._started)
        return timedelta(seconds=max(left, 0.0))

    def __repr__(self) -> str:
        return f"<StepContext {self.workflow}/{self.node} run={self.run_id} attempt={self.attempt}>"

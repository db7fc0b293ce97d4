"""What a handler sees: `StepContext`, and the fenced transaction `ctx.transaction()` opens."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

import psycopg

from cyclone.errors import CycloneError, LeaseLost
from cyclone.sql import QUERIES

Conn = psycopg.Connection[Any]


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


class Effects:
    """The one transaction an attempt's `ctx.transaction()` blocks write into.

    It is begun by the first block, on a session of its own (the worker's session is the one
    its lease keeper renews the lease on meanwhile), and left open when a block ends. The
    worker commits it in the same transaction as the step's completion, which the lease token
    fences: an attempt whose lease was revoked or reclaimed commits nothing, and a step's
    effects commit exactly when the step completes, so never twice (River's JobCompleteTx
    and sqlxmq's complete_with_transaction do the same for a job). A handler that fails, or
    an attempt that is killed, leaves them rolled back.
    """

    def __init__(self, session: Callable[[], Conn], step_id: int, token: str) -> None:
        self._session = session  # a connection not in autocommit mode, kept across steps
        self.step_id = step_id
        self.token = token
        self.conn: Conn | None = None

    @property
    def pending(self) -> bool:
        """Whether a block began the transaction: it is to commit with the completion."""
        return self.conn is not None

    def begin(self) -> Conn:
        if self.conn is None:
            conn = self._session()
            params = {"step_id": self.step_id, "token": self.token}
            # The first statement begins the transaction (the session is not in autocommit).
            self.conn = conn
            try:
                held = conn.execute(QUERIES["step_lease_held"], params).fetchone()
            except BaseException:
                self.discard()
                raise
            if held is None:
                self.discard()
                raise LeaseLost(f"step {self.step_id}: this attempt no longer holds its lease")
        return self.conn

    def commit(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.commit()

    def discard(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):  # a broken session rolled back already
                conn.rollback()


class FencedTransaction:
    """`with ctx.transaction() as conn:` (or `async with`): see `StepContext.transaction`."""

    def __init__(self, effects: Effects | None) -> None:
        self._effects = effects
        self._block: psycopg.Transaction | None = None

    def __enter__(self) -> Conn:
        if self._effects is None:
            raise CycloneError("ctx.transaction() is only available while a step runs")
        conn = self._effects.begin()
        # A savepoint inside the attempt's transaction: leaving the block by an exception
        # undoes this block's writes and lets the exception through; leaving it normally keeps
        # them pending until the step completes.
        self._block = conn.transaction()
        self._block.__enter__()
        return conn

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        block, self._block = self._block, None
        if block is not None:
            block.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> Conn:
        # The session is a blocking one: keep these blocks short in an async handler.
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


class StepContext:
    """The step being run: ids, the run's input, upstream results, and the time it has left.

    `done` is set when the step is cancelled (timeout, cancel, run deadline, shutdown): a
    cooperative handler checks it and stops. One that does not is killed anyway.
    """

    __slots__ = (
        "_deadline_left",
        "_effects",
        "_loader",
        "_patched",
        "_patches",
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
        effects: Effects | None = None,
        patched: Callable[[str], bool] | None = None,
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
        self._effects = effects
        self._patched = patched
        self._patches: dict[str, bool] = {}

    @property
    def results(self) -> Mapping[str, Any]:
        """Outputs of the run's completed nodes, by name (a map's: its items' outputs, in order).

        Read from the database on first use, so handlers that never look pay nothing.
        """
        if self._results is None:
            self._results = dict(self._loader()) if self._loader else {}
        return self._results

    def transaction(self) -> FencedTransaction:
        """A transaction on the run's database that commits only with this step's completion.

            with ctx.transaction() as conn:      # or `async with` in an async handler
                conn.execute("INSERT INTO ledger (order_id, cents) VALUES (%s, %s)", (o, c))
            return {"charged": c}

        What is written through `conn` (a psycopg connection with dict rows) is committed in
        one transaction with the step's completion, after the handler returns, and only if
        this attempt still holds its lease then: a worker frozen past its lease, a host cut
        off, an attempt killed for its timeout or a cancelled run commit none of it, and a
        retry after a crash finds nothing half-done. So effects in this database happen
        exactly once, even where no local kill can help (a whole VM frozen). A handler that
        raises, inside the block or after it, commits nothing.

        Several blocks in one handler share the one transaction; an exception that leaves a
        block undoes that block's writes. Locks taken here are held until the step completes:
        keep the rest of the handler short. Effects outside this database (an HTTP call, a
        file) are not covered: make those idempotent. Raises `LeaseLost` when the attempt
        already lost its lease.
        """
        return FencedTransaction(self._effects)

    def patched(self, change_id: str) -> bool:
        """Whether this run takes the new branch of a change to the workflow's logic.

            if ctx.patched("price-in-cents"):
                return {"total": cents(order)}
            return {"total": euros(order)}       # runs started before the change

        True for runs started after code containing this call (with this id) first
        registered, False for runs started earlier. The answer is recorded on the run by its
        first call, so every later call in the run (a retry, another node, another VM, old
        code or new) gets the same one. Once no run started before the change is live, the
        old branch and the call can be deleted (docs/deploys.md).
        """
        answer = self._patches.get(change_id)
        if answer is None:
            if self._patched is None:
                raise CycloneError("ctx.patched() is only available while a step runs")
            answer = self._patches[change_id] = self._patched(change_id)
        return answer

    def time_left(self) -> timedelta | None:
        """Time until the run's deadline (never negative), or None when it has none."""
        if self._deadline_left is None:
            return None
        left = self._deadline_left - (time.monotonic() - self._started)
        return timedelta(seconds=max(left, 0.0))

    def __repr__(self) -> str:
        return f"<StepContext {self.workflow}/{self.node} run={self.run_id} attempt={self.attempt}>"

"""Cyclone's error hierarchy: every error the library raises on purpose is a CycloneError."""

from __future__ import annotations


class CycloneError(Exception):
    """A Cyclone error."""


class RunNotFound(CycloneError, LookupError):
    """No run has this id."""


class StepNotFound(CycloneError, LookupError):
    """No step has this id."""


class WorkflowNotFound(CycloneError, LookupError):
    """No workflow is registered under this name."""


class ScheduleNotFound(CycloneError, LookupError):
    """No schedule of that name."""


class ConfigError(CycloneError, ValueError):
    """The configuration is invalid."""


class GraphError(CycloneError, ValueError):
    """A workflow graph is invalid."""


class PayloadTooLarge(CycloneError, ValueError):
    """A JSON payload is larger than the configured limit."""


class PayloadTooDeep(PayloadTooLarge):
    """A JSON payload nests arrays and objects deeper than `cyclone.db.MAX_JSON_DEPTH`."""


class PermanentError(CycloneError):
    """Raised by a handler to dead-letter its step at once, without retries."""


class RunStuck(CycloneError, TimeoutError):
    """A run can make no progress without outside help (a signal).

    A TimeoutError: under `TestEnv`, a client's `wait(run_id, timeout)` on such a run raises it
    where a real client would wait out the timeout, and code that catches the client's
    TimeoutError catches it too (issue 27, item 18)."""


class UnheardSignal(UserWarning):
    """A signal was sent to a run whose graph has no wait node listening for that name: it is
    kept (a signal may come before its wait), but most likely the name is mistyped."""


class LeaseLost(CycloneError):
    """This attempt no longer holds its step's lease: what it writes is void.

    Raised by `ctx.transaction()` when the lease was already revoked or reclaimed; the
    attempt's effects written through it are rolled back, never committed.
    """


class RunFailed(CycloneError):
    """`result()` of a run that failed: `error_kind` and `error` say why (a dead step's)."""

    def __init__(self, run_id: str, error_kind: str | None, error: str | None) -> None:
        self.run_id = run_id
        self.error_kind = error_kind
        self.error = error
        why = f"{error_kind or 'error'}: {error or ''}".rstrip(": ")
        super().__init__(f"run {run_id} failed: {why}")


class RunCancelled(CycloneError):
    """`result()` of a run that was cancelled."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.error_kind = "cancelled"
        self.error = "run cancelled"
        super().__init__(f"run {run_id} was cancelled")

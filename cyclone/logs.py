"""Log lines as JSON (`[logging] format = "json"`, SPEC section 16), with the step they concern.

One object a line. A record about a step carries `run_id`, `step_id`, `workflow`, `node`,
`attempt` (and `item`, a map item's index): the supervisor passes them as the record's extra
(`step_fields`); in a worker, `StepFields` adds the step it is running to every record its
handler logs, so a handler's own `log.info(...)` lines are found by run id too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

# The fields a record may carry, in the order they are written.
FIELDS = ("run_id", "step_id", "workflow", "node", "attempt", "item", "trace_id", "action")


class AStep(Protocol):
    step_id: int
    run_id: str
    workflow: str
    node: str
    attempt: int


def step_fields(step: AStep, item: int | None = None) -> dict[str, Any]:
    """The extra of a log record about a step (a lease the supervisor or a worker holds)."""
    fields = {
        "run_id": step.run_id, "step_id": step.step_id, "workflow": step.workflow,
        "node": step.node, "attempt": step.attempt,
    }  # fmt: skip
    if item is not None:
        fields["item"] = item
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object a line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                data[name] = value
        if record.exc_text or record.exc_info:
            # SafeRecords leaves a cleaned exc_text: never format the exception again.
            data["exc"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(data, default=str)


class StepFields(logging.Filter):
    """Adds the step a worker runs to each record that names none (installed for JSON only:
    text logs are left as they were, and nothing is read per record there), and the trace id
    of its run, where it carries one (`trace_of`, looked up once a run)."""

    def __init__(
        self, current: Callable[[], Any], trace_of: Callable[[Any], str | None] | None = None
    ) -> None:
        super().__init__()
        self.current = current
        self.trace_of = trace_of

    def filter(self, record: logging.LogRecord) -> bool:
        lease = self.current()
        if lease is not None and getattr(record, "run_id", None) is None:
            for name, value in step_fields(lease, lease.item_index).items():
                setattr(record, name, value)
            if self.trace_of is not None:
                record.trace_id = self.trace_of(lease)
        return True


def json_handlers() -> list[logging.Handler]:
    """The root logger's handlers that write JSON (set up by the supervisor before the fork)."""
    return [h for h in logging.getLogger().handlers if isinstance(h.formatter, JsonFormatter)]

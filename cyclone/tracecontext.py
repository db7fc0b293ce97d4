"""The W3C trace context a submit stores with its run (SPEC section 16), without OpenTelemetry.

A submit takes the context of the span current in the submitting code, when that code uses
OpenTelemetry (its API is imported already: Cyclone never imports it for a client), else the
`TRACEPARENT` environment variable (the carrier OpenTelemetry specifies for processes, which
`otel-cli` and CI tools set): `cyclone submit` run from a traced script joins its trace. A
child run inherits its parent's (run_submit). The context is kept as its `traceparent` header.
"""

from __future__ import annotations

import os
import re
import sys

# version 00: trace id, parent span id, flags; all-zero ids are invalid (W3C Trace Context).
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
ENV_TRACEPARENT = "TRACEPARENT"


def is_traceparent(value: object) -> bool:
    return isinstance(value, str) and _TRACEPARENT.fullmatch(value) is not None


def current_traceparent() -> str | None:
    """The traceparent of the span current here, if the program traces; else TRACEPARENT's."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is not None:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    value = os.environ.get(ENV_TRACEPARENT, "").strip().lower()
    # A malformed variable is someone else's mistake: a submit does not fail for it.
    return value if is_traceparent(value) else None


def trace_id_of(value: object) -> str | None:
    """The trace id (32 hex digits) a stored traceparent names, as trace UIs take it; None for
    none or a malformed one."""
    return value.split("-")[1] if is_traceparent(value) else None  # type: ignore[union-attr]


def parse_traceparent(value: str) -> tuple[int, int, int]:
    """(trace id, parent span id, flags) of a valid traceparent."""
    _, trace_id, span_id, flags = value.split("-")
    return int(trace_id, 16), int(span_id, 16), int(flags, 16)

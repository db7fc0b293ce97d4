"""Each attempt a span (SPEC section 16), made by the supervisor from what its workers report.

Imported only when `[tracing] enabled = true`, and then the only module that imports
OpenTelemetry (the `otel` extra). The supervisor sees every attempt begin (`leased`), end
(`done`, a kill, a crash) and every kill it orders, so the spans are made here and nothing runs
in the workers: a SIGKILLed worker could not end its own span, and a step costs a worker
nothing more with tracing on. Each span is a child of the trace context stored with its run
(cyclone/tracecontext.py), read here by run id in batches and cached.

The arbiter only enqueues (a tuple per event); a thread of ours looks the contexts up, makes
the spans with the times the events happened, and exports them in batches through the OTLP
exporter (configured by the standard OTEL_* variables). Not the SDK's BatchSpanProcessor: it
starts a thread in every process forked after it, our workers included.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Any

from cyclone.child import channel
from cyclone.db import connect
from cyclone.errors import ConfigError
from cyclone.sql import QUERIES
from cyclone.supervisor.children import HeldLease, KillReason
from cyclone.tracecontext import is_traceparent, parse_traceparent, trace_id_of

try:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
except ImportError as exc:  # pragma: no cover - the message is what matters
    raise ConfigError(
        f"[tracing] enabled = true needs the otel extra: pip install 'cyclone[otel]' ({exc})"
    ) from None

log = logging.getLogger(__name__)

# Spans are exported when this many are ready, or this long after the first of them.
EXPORT_BATCH = 512
EXPORT_EVERY = 1.0
# Runs whose trace context is kept; and attempts open at once, past which the oldest is ended
# (a lease whose end was never reported: the bound keeps a long-lived supervisor's memory flat).
CACHED_RUNS = 10_000
OPEN_SPANS = 10_000
# An outage of the collector is logged once, then at most this often.
EXPORT_WARN_EVERY = 30.0

Key = tuple[int, str]


class _Collect(SpanProcessor):  # type: ignore[misc]
    """Keeps ended spans for our thread to export: no thread of its own, no fork hook."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _attributes(lease: HeldLease) -> dict[str, Any]:
    return {
        "cyclone.run_id": lease.run_id, "cyclone.step_id": lease.step_id,
        "cyclone.workflow": lease.workflow, "cyclone.node": lease.node,
        "cyclone.attempt": lease.attempt,
    }  # fmt: skip


class AttemptTraces:
    """The arbiter's Traces port (supervisor/ports.py)."""

    def __init__(self, dsn: str, exporter: SpanExporter | None = None) -> None:
        self.dsn = dsn
        self.exporter = exporter if exporter is not None else OTLPSpanExporter()
        self.collected = _Collect()
        # From OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; "cyclone" when they name none.
        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "cyclone"}))
        # The sampler comes from OTEL_TRACES_SAMPLER (default: follow the parent's choice).
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.provider.add_span_processor(self.collected)
        self.tracer = self.provider.get_tracer("cyclone")
        self.queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.parents: OrderedDict[str, str | None] = OrderedDict()
        self.open: OrderedDict[Key, Any] = OrderedDict()
        self.conn: Any = None
        self.export_failed_at: float | None = None
        self.thread = threading.Thread(target=self._run, name="cyclone-traces", daemon=True)
        self.thread.start()

    # --- the arbiter's side: enqueue only -----------------------------------------------------

    def started(self, lease: HeldLease) -> None:
        self.queue.put(("start", lease, time.time_ns()))

    def reported(self, lease: HeldLease, done: channel.Done) -> None:
        self.queue.put(("done", lease, time.time_ns(), done))

    def killing(self, lease: HeldLease, reason: KillReason, error: str, hard: bool) -> None:
        self.queue.put(("kill", lease, time.time_ns(), reason, error, hard))

    def ended(self, lease: HeldLease, outcome: str, error: str, reason: str | None) -> None:
        self.queue.put(("end", lease, time.time_ns(), outcome, error, reason))

    def close(self, timeout: float = 5.0) -> None:
        """End what is still open, export everything, stop the thread."""
        self.queue.put(None)
        self.thread.join(timeout)
        self.provider.shutdown()

    # --- our thread -----------------------------------------------------------------------

    def _run(self) -> None:
        first_ready: float | None = None
        while True:
            wait = (
                EXPORT_EVERY
                if first_ready is None
                else max(0.0, first_ready + EXPORT_EVERY - time.monotonic())
            )
            items: list[tuple[Any, ...] | None] = []
            try:
                items.append(self.queue.get(timeout=wait))
                while True:
                    items.append(self.queue.get_nowait())
            except queue.Empty:
                pass
            closing = None in items
            self._apply([i for i in items if i is not None])
            if closing:
                for key in list(self.open):
                    self._end(key, time.time_ns(), "unknown", "the supervisor stopped", None)
            if self.collected.spans and first_ready is None:
                first_ready = time.monotonic()
            due = first_ready is not None and time.monotonic() >= first_ready + EXPORT_EVERY
            if self.collected.spans and (
                closing or due or len(self.collected.spans) >= EXPORT_BATCH
            ):
                self._export()
                first_ready = None
            if closing:
                if self.conn is not None:
                    self.conn.close()
                return

    def _apply(self, items: list[tuple[Any, ...]]) -> None:
        self._look_up({i[1].run_id for i in items if i[0] == "start"})
        for item in items:
            if item[0] == "start":
                # The supervisor's later lines about this attempt carry it (outcomes.py).
                item[1].trace_id = trace_id_of(self.parents.get(item[1].run_id))
        for item in items:
            try:
                getattr(self, "_on_" + item[0])(*item[1:])
            except Exception:  # a span we failed to make must not stop the others
                log.exception("tracing: could not record a span event")

    def _look_up(self, run_ids: set[str]) -> None:
        missing = [r for r in run_ids if r not in self.parents]
        if not missing:
            return
        found: dict[str, str | None] = {}
        try:
            if self.conn is None or self.conn.closed or self.conn.broken:
                self.conn = connect(self.dsn, "cyclone-tracing", connect_timeout=5)
            rows = self.conn.execute(QUERIES["run_trace_parents"], {"run_ids": missing})
            found = {r["run_id"]: r["trace_parent"] for r in rows.fetchall()}
        except Exception as exc:  # the database is away: these attempts start traces of their own
            log.warning("tracing: could not read the runs' trace contexts: %s", exc)
        for run_id in missing:
            self.parents[run_id] = found.get(run_id)
        while len(self.parents) > CACHED_RUNS:
            self.parents.popitem(last=False)

    def _parent(self, run_id: str) -> Any:
        value = self.parents.get(run_id)
        if value is None or not is_traceparent(value):
            return None
        trace_id, span_id, flags = parse_traceparent(value)
        remote = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
        return trace.set_span_in_context(trace.NonRecordingSpan(remote))

    def _on_start(self, lease: HeldLease, at: int) -> None:
        key = (lease.step_id, lease.token)
        span = self.tracer.start_span(
            f"{lease.workflow}/{lease.node}", context=self._parent(lease.run_id),
            kind=SpanKind.CONSUMER, attributes=_attributes(lease), start_time=at,
        )  # fmt: skip
        self.open[key] = span
        while len(self.open) > OPEN_SPANS:
            old = next(iter(self.open))
            self._end(old, at, "unknown", "its end was never reported", None)

    def _on_done(self, lease: HeldLease, at: int, done: channel.Done) -> None:
        span = self.open.get((lease.step_id, lease.token))
        if span is None:
            return
        if done.outcome == "lost":
            span.add_event("lease lost", {"cyclone.detail": "result discarded"}, timestamp=at)
        elif done.outcome == "failed" and done.retry:
            span.add_event("retry", {"cyclone.error": done.error or ""}, timestamp=at)
        kind = "error" if done.outcome == "failed" else None
        self._end((lease.step_id, lease.token), at, done.outcome, done.error, kind)

    def _on_kill(
        self, lease: HeldLease, at: int, reason: KillReason, error: str, hard: bool
    ) -> None:
        span = self.open.get((lease.step_id, lease.token))
        if span is None:
            return
        name = "deadline" if reason == KillReason.DEADLINE else "kill"
        span.add_event(name, {
            "cyclone.kill.reason": str(reason), "cyclone.kill.signal": "SIGKILL" if hard
            else "SIGTERM", "cyclone.error": error,
        }, timestamp=at)  # fmt: skip

    def _on_end(
        self, lease: HeldLease, at: int, outcome: str, error: str, reason: str | None
    ) -> None:
        self._end((lease.step_id, lease.token), at, outcome, error, reason)

    def _end(self, key: Key, at: int, outcome: str, error: str | None, kind: str | None) -> None:
        span = self.open.pop(key, None)
        if span is None:
            return
        span.set_attribute("cyclone.outcome", outcome)
        if outcome not in ("completed", "expanded"):
            if kind is not None:
                span.set_attribute("cyclone.error_kind", kind)
            span.set_status(Status(StatusCode.ERROR, error or outcome))
        span.end(end_time=at)

    def _export(self) -> None:
        spans, self.collected.spans = self.collected.spans, []
        try:
            result = self.exporter.export(spans)
        except Exception as exc:
            result, why = SpanExportResult.FAILURE, str(exc)
        else:
            why = "the collector refused them"
        now = time.monotonic()
        if result is SpanExportResult.SUCCESS:
            if self.export_failed_at is not None:
                log.info("tracing: exporting spans again", extra={"action": "trace"})
            self.export_failed_at = None
        elif self.export_failed_at is None or now - self.export_failed_at >= EXPORT_WARN_EVERY:
            log.warning(
                "tracing: %d spans not exported (%s); next warning in %.0fs at the earliest",
                len(spans), why, EXPORT_WARN_EVERY, extra={"action": "trace"},
            )  # fmt: skip
            self.export_failed_at = now

"""Traces end to end (SPEC section 16): a real supervisor exports each attempt as a span over
OTLP/HTTP to a receiver in this test, which decodes the protobuf as a collector would.

The runs are submitted inside a span of the test's own (the web request of an application):
every attempt, the child run's included, is a child of that span; the attempts the supervisor
killed for their timeout carry the kill as an event, and their span ends with its reason.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from proc_helpers import terminal, wait_for

from cyclone.states import RunState

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2", reason="opentelemetry-proto"
)


class Receiver:
    """The OTLP/HTTP traces endpoint of a collector: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service.ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    for resource_spans in request.resource_spans:
                        receiver.resources.append(attributes(resource_spans.resource))
                        for scope in resource_spans.scope_spans:
                            receiver.spans.extend(scope.spans)
                reply = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def named(self, name: str) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if s.name == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(item: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in item.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_attempts_are_spans_of_the_submitters_trace(env, supervisor, receiver, tmp_path) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    sup = supervisor(
        tracing__enabled="true",
        environ={
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
            "OTEL_SERVICE_NAME": "cyclone-proc-test",
        },
    )
    tracer = TracerProvider().get_tracer("web")
    with tracer.start_as_current_span("POST /orders") as request:
        run_id = env.client.submit("proc-traced")
        # A 1 s timeout, twice: killed twice.
        killed_id = env.client.submit("proc-timed", {"dir": str(tmp_path)})
    root = request.get_span_context()
    untraced_id = env.client.submit("proc-traced-child")  # outside any span: a trace of its own

    for rid in (run_id, killed_id, untraced_id):
        wait_for(lambda rid=rid: terminal(env, rid), 30, f"run {rid} to end\n{sup.log()}")
    assert env.client.get_run(run_id).state == RunState.COMPLETED
    assert env.client.get_run(killed_id).state == RunState.FAILED

    wait_for(
        lambda: len(receiver.named("proc-traced/first")) == 1
        and len(receiver.named("proc-traced/sub")) == 1
        and len(receiver.named("proc-traced-child/leaf")) == 2
        and len(receiver.named("proc-timed/hang")) == 2,
        30, f"the spans to be exported\n{sup.log()}",
    )  # fmt: skip
    assert {r["service.name"] for r in receiver.resources} == {"cyclone-proc-test"}

    ours = [
        *receiver.named("proc-traced/first"), *receiver.named("proc-traced/sub"),
        *receiver.named("proc-timed/hang"),
        *[s for s in receiver.named("proc-traced-child/leaf")
          if attributes(s)["cyclone.run_id"] != untraced_id],
    ]  # fmt: skip
    assert len(ours) == 5
    for span in ours:
        # Children of the request's span, the child run's attempt included (inherited).
        assert int.from_bytes(span.trace_id, "big") == root.trace_id
        assert int.from_bytes(span.parent_span_id, "big") == root.span_id

    first = receiver.named("proc-traced/first")[0]
    attrs = attributes(first)
    assert attrs["cyclone.run_id"] == run_id
    assert attrs["cyclone.workflow"] == "proc-traced"
    assert attrs["cyclone.node"] == "first"
    assert attrs["cyclone.attempt"] == 1
    assert attrs["cyclone.outcome"] == "completed"
    assert first.end_time_unix_nano > first.start_time_unix_nano

    hangs = receiver.named("proc-timed/hang")
    hangs.sort(key=lambda s: attributes(s)["cyclone.attempt"])
    assert [attributes(s)["cyclone.attempt"] for s in hangs] == [1, 2]
    for span in hangs:
        attrs = attributes(span)
        assert attrs["cyclone.run_id"] == killed_id
        assert attrs["cyclone.outcome"] == "killed"
        assert attrs["cyclone.error_kind"] == "timeout"
        assert span.status.code == span.status.STATUS_CODE_ERROR
        assert "killed (timeout)" in span.status.message
        kills = [e for e in span.events if e.name == "kill"]
        assert kills, [e.name for e in span.events]
        assert attributes(kills[0])["cyclone.kill.reason"] == "timeout"
        # Ended by the supervisor, after the kill it ordered.
        assert span.end_time_unix_nano >= kills[0].time_unix_nano

    (alone,) = [
        s for s in receiver.named("proc-traced-child/leaf")
        if attributes(s)["cyclone.run_id"] == untraced_id
    ]  # fmt: skip
    assert int.from_bytes(alone.trace_id, "big") != root.trace_id
    assert not alone.parent_span_id

"""Prometheus metrics, kept by the supervisor and served from its loop.

Workers report leases and outcomes over their pipes, and the supervisor counts them: one
registry per host, no multiprocess files (they leak with churning workers). `/metrics` is
served by threads of its own (`MetricsServer`), never by the supervisor's loop: a client that
trickled its request a byte at a time held the loop, and every kill with it, for as long as it
went on (issue 22). Each request has a deadline for the whole of it and a size cap.

The scanner reports each pass over its pipe (`scanned`): lease expirations, runs it failed
and when it last finished a pass. Gauges read from the database (DLQ depth, runs by state,
`cyclone_db_up`) come from `gauges.DatabaseGauges`, a collector with a statement timeout and a
short cache. Every label has a bounded set of values: workflow and node names come from code,
reasons and outcomes from enums; run and step ids never appear.
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import unquote

import psycopg
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cyclone.child.channel import ExitCode, Scanned
from cyclone.engine.sweeps import SWEEPS
from cyclone.supervisor.children import (
    ExitBy,
    ExitStatus,
    HeldLease,
    KillReason,
    Role,
    WorkerHandle,
    exit_by,
)
from cyclone.supervisor.gauges import DatabaseGauges
from cyclone.supervisor.labels import MAX_NODES, MAX_WORKFLOWS, LabelCap, top

log = logging.getLogger(__name__)

# A scrape is served off the supervisor's loop, one thread a connection: reading the request
# and writing the answer take at most REQUEST_DEADLINE together (a client that trickles a byte
# every 0.2 s is cut off, not waited for), a request head over MAX_REQUEST_BYTES is refused,
# and past MAX_CONNECTIONS at once a new connection is closed unanswered.
REQUEST_DEADLINE = 5.0
MAX_REQUEST_BYTES = 8192
MAX_CONNECTIONS = 4
# How often the accepting thread looks whether the server was closed.
_ACCEPT_POLL = 0.5
# The scanner's sweeps whose rows are runs failed, by the reason they failed for, and those
# whose rows are expired leases reclaimed (declared in cyclone/engine/sweeps.py).
RUNS_FAILED_BY = {s.name: str(s.runs_failed) for s in SWEEPS if s.runs_failed is not None}
LEASES_RECLAIMED_BY = tuple(s.name for s in SWEEPS if s.leases_reclaimed)


class Metrics:
    """The arbiter's observer: turns what happens to children into Prometheus series."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]] | None = None,
        primary: Callable[[], psycopg.Connection[Any]] | None = None,
    ) -> None:
        # No `*_created` series beside every counter and histogram: a timestamp per label set
        # that no dashboard or alert reads, doubling what each scrape carries.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.children: dict[int, WorkerHandle] = {}
        self._labelled: dict[tuple[Any, ...], Any] = {}  # labelled children, see _child
        # Names come from whoever registered the graph: a bounded number of series each.
        self.workflow_label = LabelCap(MAX_WORKFLOWS)
        self.node_label = LabelCap(MAX_NODES)
        r = self.registry
        self.leases = Counter("cyclone_leases", "Steps leased", ["workflow", "node"], registry=r)
        self.steps = Counter(
            "cyclone_steps", "Attempts finished", ["workflow", "node", "outcome"], registry=r
        )
        self.durations = Histogram(
            "cyclone_step_duration_seconds", "Attempt duration", ["workflow", "node"], registry=r
        )
        self.kills = Counter("cyclone_worker_kills", "Workers killed", ["reason"], registry=r)
        self.restarts = Counter(
            "cyclone_worker_restarts", "Child processes that exited", ["reason"], registry=r
        )
        self.lease_expirations = Counter(
            "cyclone_lease_expirations", "Leases the scanner reclaimed after they expired",
            registry=r,
        )  # fmt: skip
        self.runs_failed_total = Counter(
            "cyclone_scanner_runs_failed", "Runs the scanner failed", ["reason"], registry=r
        )
        for reason in RUNS_FAILED_BY.values():
            self.runs_failed_total.labels(reason)
        self.last_scan = Gauge(
            "cyclone_scanner_last_scan_timestamp_seconds",
            "When the scanner last finished a pass (Unix time)", registry=r,
        )  # fmt: skip
        self.batches = Histogram(
            "cyclone_dispatch_batch_steps",
            "Steps a dispatch statement leased (supervisor/dispatch.py)",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64), registry=r,
        )  # fmt: skip
        for reason in KillReason:
            self.kills.labels(str(reason))
        r.register(_LiveCollector(self))
        if connect is not None:
            r.register(DatabaseGauges(connect, primary=primary))

    def watch(self, children: dict[int, WorkerHandle]) -> None:
        self.children = children

    def leased(self, lease: HeldLease) -> None:
        self._child(self.leases, lease.workflow, lease.node).inc()

    def finished(self, lease: HeldLease, outcome: str, duration: float | None) -> None:
        self._child(self.steps, lease.workflow, lease.node, outcome).inc()
        if duration is not None:
            self._child(self.durations, lease.workflow, lease.node).observe(duration)

    def _child(self, metric: Any, workflow: str, node: str, *labels: str) -> Any:
        # `labels()` costs microseconds (validation, a lock); twice a step it added up. This
        # cache is keyed by the names as reported, so it is bounded only as far as they are.
        key = (id(metric), workflow, node, *labels)
        child = self._labelled.get(key)
        if child is None:
            capped = (self.workflow_label(workflow), self.node_label(node))
            if capped != (workflow, node):
                return metric.labels(*capped, *labels)  # not cached: that would grow too
            child = self._labelled[key] = metric.labels(workflow, node, *labels)
        return child

    def dispatched(self, leased: int) -> None:
        self.batches.observe(leased)

    def killed(self, reason: KillReason) -> None:
        self.kills.labels(str(reason)).inc()

    def scanned(self, report: Scanned) -> None:
        counts = report.counts if isinstance(report.counts, dict) else {}
        for sweep in LEASES_RECLAIMED_BY:
            expired = counts.get(sweep)
            if isinstance(expired, int) and expired > 0:
                self.lease_expirations.inc(expired)
        for sweep, reason in RUNS_FAILED_BY.items():
            failed = counts.get(sweep)
            if isinstance(failed, int):
                self.runs_failed(reason, failed)
        if report.ok and isinstance(report.at, int | float):
            self.last_scan.set(report.at)

    def runs_failed(self, reason: str, count: int) -> None:
        """Runs the scanner's sweeps failed, or the supervisor's own deadline sweep did."""
        if count > 0:
            self.runs_failed_total.labels(reason).inc(count)

    def exited(self, handle: WorkerHandle, status: ExitStatus) -> None:
        if handle.kill is not None:
            reason = f"killed_{handle.kill.reason}"
        elif status.signal is not None:
            reason = "signal"
        elif exit_by(handle, status) is ExitBy.HANDLER:
            reason = "handler_exit"  # its code is the handler's, not one of ExitCode's
        else:
            # A label from a fixed set: an exit code outside the protocol is just "exit".
            try:
                reason = ExitCode(status.code).name.lower()
            except ValueError:
                reason = "exit"
        self.restarts.labels(reason).inc()


class _LiveCollector(Collector):
    """Gauges computed from the children at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        # list() copies the values in one step: the supervisor's loop changes the dict while
        # a metrics thread reads it.
        workers = [h for h in list(self.metrics.children.values()) if h.role is Role.WORKER]
        states = GaugeMetricFamily("cyclone_workers", "Worker processes", labels=["state"])
        busy = sum(1 for h in workers if h.busy)
        states.add_metric(["busy"], busy)
        states.add_metric(["idle"], len(workers) - busy)
        yield states
        active = GaugeMetricFamily("cyclone_leases_active", "Steps running", labels=["workflow"])
        running = Tally(h.lease.workflow for h in workers if h.lease)
        for workflow, count in top(running, MAX_WORKFLOWS):
            active.add_metric([workflow], count)
        yield active


class _Refused(Exception):
    """A request not served: the status to answer with, when there is one to send."""

    def __init__(self, status: str | None, why: str) -> None:
        super().__init__(why)
        self.status = status


class MetricsServer:
    """`/metrics` served by threads of its own: the supervisor's loop never waits on a client.

    The WSGI app of prometheus_client renders the answer (content negotiation, gzip, `name[]`
    filters); what reads the request and writes the answer is here, so that the deadline covers
    the whole request rather than each read (as wsgiref's timeouts do). The answers close their
    connection with a shutdown, not only a close: a worker forked while a request was open holds
    a copy of its socket, which a close alone would leave open to the client.
    """

    def __init__(self, metrics: Metrics, bind: str, port: int) -> None:
        self.app = make_wsgi_app(metrics.registry)
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.socket = socket.create_server((bind, port), family=family, backlog=16)
        self.socket.settimeout(_ACCEPT_POLL)
        host, self.port = self.socket.getsockname()[:2]
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.render_lock = threading.Lock()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="cyclone-metrics", daemon=True)
        self.thread.start()
        log.info("metrics at http://%s:%d/metrics", host, self.port, extra={"action": "metrics"})

    def fileno(self) -> int:
        return self.socket.fileno()

    def close(self) -> None:
        self.closed.set()
        self.socket.close()
        self.thread.join(timeout=2 * _ACCEPT_POLL)

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, address = self.socket.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.closed.is_set():
                    return
                log.debug("metrics: accept failed: %s", exc)
                time.sleep(0.1)  # out of descriptors, say: not a busy loop
                continue
            if not self.slots.acquire(blocking=False):
                _hang_up(conn)  # MAX_CONNECTIONS served already: no thread for another
                continue
            threading.Thread(
                target=self._serve, args=(conn, address), name="cyclone-metrics-request",
                daemon=True,
            ).start()  # fmt: skip

    def _serve(self, conn: socket.socket, address: Any) -> None:
        deadline = time.monotonic() + REQUEST_DEADLINE
        try:
            try:
                head = _read_head(conn, deadline)
                answer = self._answer(head, address)
            except _Refused as refused:
                log.debug("metrics: request from %s refused: %s", address, refused)
                if refused.status is None:
                    return
                answer = _response(refused.status, [], f"{refused}\n".encode(), head=False)
            _send_all(conn, answer, deadline)
        except OSError as exc:  # TimeoutError included: the deadline passed
            log.debug("metrics: request from %s failed: %s", address, exc)
        finally:
            _hang_up(conn)
            self.slots.release()

    def _answer(self, head: bytes, address: Any) -> bytes:
        try:
            request_line, *lines = head.decode("latin-1").split("\n")
            method, target, _version = request_line.split()
        except ValueError:
            raise _Refused("400 Bad Request", "not an HTTP request") from None
        path, _, query = target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": "GET" if method == "HEAD" else method,
            "PATH_INFO": unquote(path), "QUERY_STRING": query, "SERVER_PROTOCOL": "HTTP/1.0",
            "SERVER_NAME": "cyclone", "SERVER_PORT": str(self.port),
            "REMOTE_ADDR": str(address[0]) if address else "", "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(), "wsgi.errors": io.StringIO(), "wsgi.version": (1, 0),
            "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        }  # fmt: skip
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
            started[:] = [status, headers]

        # One scrape renders at a time (the database gauges share one session); the clients'
        # reads and writes, the slow part, are outside the lock.
        with self.render_lock:
            body = b"".join(self.app(environ, start_response))
        return _response(started[0], started[1], body, head=method == "HEAD")


def _read_head(conn: socket.socket, deadline: float) -> bytes:
    """The request line and headers, read before `deadline` and within MAX_REQUEST_BYTES."""
    data = b""
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            end = data.find(b"\n\n")
        if end >= 0:
            return data[:end].replace(b"\r\n", b"\n")
        if len(data) > MAX_REQUEST_BYTES:
            raise _Refused("431 Request Header Fields Too Large", f"over {MAX_REQUEST_BYTES} bytes")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Refused(None, f"request not read within {REQUEST_DEADLINE:g}s")
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(MAX_REQUEST_BYTES + 1 - len(data))
        except TimeoutError:
            raise _Refused(None, f"request not read within {REQUEST_DEADLINE:g}s") from None
        if not chunk:
            raise _Refused(None, "closed before the end of its request")
        data += chunk


def _response(status: str, headers: Iterable[tuple[str, str]], body: bytes, *, head: bool) -> bytes:
    lines = [f"HTTP/1.0 {status}"]
    lines += [f"{name}: {value}" for name, value in headers if name.lower() != "content-length"]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + (b"" if head else body)


def _send_all(conn: socket.socket, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"answer not taken within {REQUEST_DEADLINE:g}s")
        conn.settimeout(remaining)
        view = view[conn.send(view[:65536]) :]


def _hang_up(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):  # the client went first
        conn.shutdown(socket.SHUT_RDWR)
    conn.close()

"""Prometheus metrics, kept by the supervisor and served from its loop.

Workers report leases and outcomes over their pipes, and the supervisor counts them: one
registry per host, no multiprocess files (they leak with churning workers). `/metrics` is a
wsgiref server whose socket sits in the supervisor's selector, so serving it needs no thread;
`prometheus_client.start_http_server` would start one in the process that forks.

The scanner reports each pass over its pipe (`scanned`): lease expirations, runs it failed
and when it last finished a pass. Gauges read from the database (DLQ depth, runs by state,
`cyclone_db_up`) come from `gauges.DatabaseGauges`, a collector with a statement timeout and a
short cache. Every label has a bounded set of values: workflow and node names come from code,
reasons and outcomes from enums; run and step ids never appear.
"""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
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

log = logging.getLogger(__name__)

# A scrape is served inside the supervisor's loop: a client that connects and then stalls
# may hold the loop up for at most this long.
IO_TIMEOUT = 0.25
# The scanner's sweeps whose rows are runs failed, by the reason they failed for, and those
# whose rows are expired leases reclaimed (declared in cyclone/engine/sweeps.py).
RUNS_FAILED_BY = {s.name: str(s.runs_failed) for s in SWEEPS if s.runs_failed is not None}
LEASES_RECLAIMED_BY = tuple(s.name for s in SWEEPS if s.leases_reclaimed)


class Metrics:
    """The arbiter's observer: turns what happens to children into Prometheus series."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.children: dict[int, WorkerHandle] = {}
        self._labelled: dict[tuple[Any, ...], Any] = {}  # labelled children, see _child
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
            r.register(DatabaseGauges(connect))

    def watch(self, children: dict[int, WorkerHandle]) -> None:
        self.children = children

    def leased(self, lease: HeldLease) -> None:
        self._child(self.leases, lease.workflow, lease.node).inc()

    def finished(self, lease: HeldLease, outcome: str, duration: float | None) -> None:
        self._child(self.steps, lease.workflow, lease.node, outcome).inc()
        if duration is not None:
            self._child(self.durations, lease.workflow, lease.node).observe(duration)

    def _child(self, metric: Any, *labels: str) -> Any:
        # `labels()` costs microseconds (validation, a lock); twice a step it added up. The
        # label values are bounded (workflows and nodes the supervisor loaded), so is this.
        key = (id(metric), *labels)
        child = self._labelled.get(key)
        if child is None:
            child = self._labelled[key] = metric.labels(*labels)
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
        workers = [h for h in self.metrics.children.values() if h.role is Role.WORKER]
        states = GaugeMetricFamily("cyclone_workers", "Worker processes", labels=["state"])
        busy = sum(1 for h in workers if h.busy)
        states.add_metric(["busy"], busy)
        states.add_metric(["idle"], len(workers) - busy)
        yield states
        active = GaugeMetricFamily("cyclone_leases_active", "Steps running", labels=["workflow"])
        for workflow, count in sorted(Tally(h.lease.workflow for h in workers if h.lease).items()):
            active.add_metric([workflow], count)
        yield active


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape is noise

    def setup(self) -> None:
        self.request.settimeout(IO_TIMEOUT)
        super().setup()


class MetricsServer:
    """`/metrics` on a socket the supervisor's selector watches."""

    def __init__(self, metrics: Metrics, bind: str, port: int) -> None:
        self.server: WSGIServer = make_server(
            bind, port, make_wsgi_app(metrics.registry), handler_class=_QuietHandler
        )
        self.server.socket.setblocking(False)
        host, self.port = self.server.server_address[:2]
        log.info("metrics at http://%s:%d/metrics", host, self.port, extra={"action": "metrics"})

    def fileno(self) -> int:
        return self.server.fileno()

    def handle(self) -> None:
        """One pending connection (the selector said the socket is readable)."""
        try:
            request, address = self.server.socket.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            request.setblocking(True)
            self.server.process_request(request, address)
        except (TimeoutError, OSError) as exc:
            log.debug("metrics request failed: %s", exc)
            self.server.shutdown_request(request)

    def close(self) -> None:
        self.server.server_close()

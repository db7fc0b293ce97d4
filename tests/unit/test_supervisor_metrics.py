"""The supervisor's metrics: counted from what its children report, served without a thread."""

from __future__ import annotations

import signal
import socket

from prometheus_client import generate_latest

from cyclone.supervisor.children import ExitStatus, HeldLease, KillReason, Role, WorkerHandle
from cyclone.supervisor.metrics import Metrics, MetricsServer

LEASE = HeldLease(
    step_id=1, token="t", run_id="r", workflow="orders", node="reserve", attempt=1,
    leased_at=0.0, timeout_at=None, deadline_at=None,
)  # fmt: skip


def render(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_leases_outcomes_kills_and_exits_are_counted() -> None:
    metrics = Metrics()
    metrics.leased(LEASE)
    metrics.finished(LEASE, "completed", 0.5)
    metrics.killed(KillReason.TIMEOUT)
    handle = WorkerHandle(pid=10, role=Role.WORKER, number=1, generation=0, fd=-1,
                          spawned_at=0.0, last_seen=0.0)  # fmt: skip
    metrics.exited(handle, ExitStatus(signal=signal.SIGKILL))
    metrics.exited(handle, ExitStatus(code=5))
    metrics.exited(handle, ExitStatus(code=42))  # not a protocol code: no label of its own
    text = render(metrics)
    assert 'cyclone_leases_total{node="reserve",workflow="orders"} 1.0' in text
    assert 'cyclone_steps_total{node="reserve",outcome="completed",workflow="orders"} 1.0' in text
    assert 'cyclone_step_duration_seconds_count{node="reserve",workflow="orders"} 1.0' in text
    assert 'cyclone_worker_kills_total{reason="timeout"} 1.0' in text
    assert 'cyclone_worker_restarts_total{reason="signal"} 1.0' in text
    assert 'cyclone_worker_restarts_total{reason="recycle"} 1.0' in text
    assert 'cyclone_worker_restarts_total{reason="exit"} 1.0' in text


def test_busy_and_idle_workers_and_active_leases_are_read_at_scrape_time() -> None:
    metrics = Metrics()
    busy = WorkerHandle(pid=1, role=Role.WORKER, number=1, generation=0, fd=-1,
                        spawned_at=0.0, last_seen=0.0, lease=LEASE)  # fmt: skip
    idle = WorkerHandle(pid=2, role=Role.WORKER, number=2, generation=0, fd=-1,
                        spawned_at=0.0, last_seen=0.0)  # fmt: skip
    metrics.watch({1: busy, 2: idle})
    text = render(metrics)
    assert 'cyclone_workers{state="busy"} 1.0' in text
    assert 'cyclone_workers{state="idle"} 1.0' in text
    assert 'cyclone_leases_active{workflow="orders"} 1.0' in text


def test_metrics_are_served_on_loopback_one_request_per_readable_socket() -> None:
    metrics = Metrics()
    metrics.killed(KillReason.CANCEL)
    server = MetricsServer(metrics, "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as client:
            client.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            server.handle()
            response = b""
            while chunk := client.recv(65536):
                response += chunk
        assert response.startswith(b"HTTP/1.0 200")
        assert b'cyclone_worker_kills_total{reason="cancel"} 1.0' in response
        server.handle()  # nothing pending: returns at once
    finally:
        server.close()

"""The supervisor's metrics: counted from what its children report, served by threads of their
own with a deadline for each whole request."""

from __future__ import annotations

import contextlib
import signal
import socket
import time

from prometheus_client import generate_latest

from cyclone.supervisor import metrics as metrics_module
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
    # Issue 27, item 16: no `*_created` series beside each counter and histogram.
    assert "_created" not in text


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


def _get(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(request)
        response = b""
        while chunk := client.recv(65536):
            response += chunk
    return response


def test_metrics_are_served_on_loopback_by_a_thread_of_their_own() -> None:
    metrics = Metrics()
    metrics.killed(KillReason.CANCEL)
    server = MetricsServer(metrics, "127.0.0.1", 0)
    try:
        response = _get(server.port, b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        assert response.startswith(b"HTTP/1.0 200")
        assert b'cyclone_worker_kills_total{reason="cancel"} 1.0' in response
        head = _get(server.port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200") and head.endswith(b"\r\n\r\n")
    finally:
        server.close()
    assert not server.thread.is_alive()


def test_a_request_is_cut_off_at_its_deadline_and_its_size_cap(monkeypatch) -> None:
    monkeypatch.setattr(metrics_module, "REQUEST_DEADLINE", 1.0)
    server = MetricsServer(Metrics(), "127.0.0.1", 0)
    try:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as client:
            # One byte every 0.2 s: each read is quick, the whole is never done.
            with contextlib.suppress(OSError):
                for byte in b"GET /metrics HTTP/1.0\r\nHost: " + b"x" * 100:
                    client.send(bytes([byte]))
                    time.sleep(0.2)
                    if time.monotonic() - started > 4:
                        break
            try:
                answer = client.recv(1)
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # hung up on, unanswered
        assert time.monotonic() - started < 2.5
        too_big = b"GET /metrics HTTP/1.0\r\nX: "
        too_big += b"y" * (metrics_module.MAX_REQUEST_BYTES + 1 - len(too_big))  # all read
        assert _get(server.port, too_big).startswith(b"HTTP/1.0 431")
        # Meanwhile and after, others are served.
        assert _get(server.port, b"GET / HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200")
    finally:
        server.close()

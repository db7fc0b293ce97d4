"""A real supervisor's /metrics, presence rows and systemd notifications, after real kills."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
from proc_helpers import sample, terminal, wait_for

from cyclone.states import RunState
from cyclone.supervisor.dispatch import SESSIONS

pytestmark = pytest.mark.process


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the TCP sockets listening on `port`, from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_counters_and_dlq_depth_match_the_kills_that_happened(env, supervisor, tmp_path) -> None:
    from proc_flows import stubborn, timed

    sup = supervisor(workers=3)
    late = env.client.submit(stubborn, {"dir": str(tmp_path)}, run_deadline=1.5)
    cancelled = env.client.submit(stubborn, {"dir": str(tmp_path)})
    slow = env.client.submit(timed, {"dir": str(tmp_path)})  # two attempts, both time out
    wait_for(lambda: (tmp_path / f"{cancelled}.1.pids").exists(), 15, "the handler to start")
    env.client.cancel(cancelled)
    wait_for(lambda: all(terminal(env, r) for r in (late, cancelled, slow)), 20, "the runs")
    # Each killed worker is reaped (and counted) before its replacement is spawned.
    wait_for(lambda: len(sup.workers()) == 3, 5, "the replacements")
    text = sup.metrics()

    def value(name: str, **labels: str) -> float | None:
        return sample(text, name, **labels)

    assert value("cyclone_worker_kills_total", reason="deadline") == 1
    assert value("cyclone_worker_kills_total", reason="cancel") == 1
    assert value("cyclone_worker_kills_total", reason="timeout") == 2
    assert value("cyclone_worker_kills_total", reason="shutdown") == 0
    assert value("cyclone_dlq_depth", reason="deadline") == 1
    assert value("cyclone_dlq_depth", reason="timeout") == 1
    assert value("cyclone_dlq_depth", reason="error") == 0
    assert value("cyclone_runs_active", state="running") == 0
    assert value("cyclone_db_up") == 1
    assert value("cyclone_scanner_runs_failed_total", reason="deadline") == 1
    assert value("cyclone_scanner_last_scan_timestamp_seconds") > 1e9
    assert value("cyclone_lease_expirations_total") == 0
    timeouts = value("cyclone_steps_total", workflow="proc-timed", node="hang", outcome="timeout")
    assert timeouts == 2
    assert value("cyclone_leases_total", workflow="proc-stubborn", node="hang") == 2
    assert value("cyclone_worker_restarts_total", reason="killed_timeout") == 2
    assert value("cyclone_workers", state="idle") == 3
    assert value("cyclone_step_duration_seconds_count", workflow="proc-timed", node="hang") == 2
    # Served on loopback only: the default bind is 127.0.0.1.
    port = int(sup.metrics_url().rsplit(":", 1)[1].split("/")[0])
    assert listening_addresses(port) == ["0100007F"]
    assert sup.metrics_url().startswith("http://127.0.0.1:")


def test_presence_rows_follow_the_workers_and_go_on_a_clean_exit(env, supervisor, tmp_path):
    from proc_flows import stubborn

    before = env.conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    sup = supervisor(workers=2)
    run_id = env.client.submit(stubborn, {"dir": str(tmp_path)})

    def busy_row():
        return env.conn.execute(
            "SELECT w.*, s.pid AS sup_pid FROM cyclone_workers w"
            " JOIN cyclone_supervisors s ON s.id = w.supervisor_id WHERE w.state = 'busy'"
        ).fetchone()

    row = wait_for(busy_row, 10, "a busy worker row")
    assert (str(row["run_id"]), row["workflow"], row["node"]) == (run_id, "proc-stubborn", "hang")
    assert row["sup_pid"] == sup.pid and row["pid"] in sup.workers()
    # pg_stat_activity names each of this supervisor's sessions (LISTEN and presence kept).
    names = {r["application_name"] for r in env.conn.execute(
        "SELECT application_name FROM pg_stat_activity"
        " WHERE datname = current_database() AND backend_start >= %s", (before,),
    )}  # fmt: skip
    assert {
        "cyclone-worker-1", "cyclone-worker-2", "cyclone-scanner", "cyclone-supervisor",
    } <= names  # fmt: skip
    env.client.cancel(run_id)
    wait_for(lambda: not busy_row(), 10, "the worker row to turn idle")
    sup.popen.send_signal(signal.SIGTERM)
    assert sup.popen.wait(10) == 0, sup.log()
    assert env.conn.execute("SELECT count(*) AS n FROM cyclone_supervisors").fetchone()["n"] == 0
    assert env.conn.execute("SELECT count(*) AS n FROM cyclone_workers").fetchone()["n"] == 0


def test_systemd_hears_ready_after_metrics_are_up_then_stopping_on_drain(
    env, supervisor, tmp_path
) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(15)
        sup = supervisor(workers=2, environ={"NOTIFY_SOCKET": path}, wait=False)
        ready = sock.recv(4096).decode()
        assert ready.startswith("READY=1\nSTATUS=") and f"MAINPID={sup.pid}" in ready
        # By READY=1 the metrics endpoint answers and the workers are forked.
        assert sample(sup.metrics(), "cyclone_db_up") == 1
        assert "spawned worker 2" in sup.log()
        sup.wait_ready(2)
        sup.popen.send_signal(signal.SIGTERM)
        messages = [sock.recv(4096).decode()]
        while not messages[-1].startswith("STOPPING=1"):
            messages.append(sock.recv(4096).decode())
        assert all(m.startswith("STATUS=") for m in messages[:-1])
        assert sup.popen.wait(10) == 0


def test_many_worker_respawns_leave_no_files_and_no_descriptors(env, supervisor, tmp_path):
    from proc_flows import busy

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    environ = {"TMPDIR": str(scratch)}
    sup = supervisor(workers=2, environ=environ, supervisor__max_steps_per_worker="1")
    fds = len(os.listdir(f"/proc/{sup.pid}/fd"))
    inputs = [{"dir": str(tmp_path), "n": n, "sleep": 0} for n in range(60)]
    run_ids = env.client.submit_many(busy, inputs)
    wait_for(
        lambda: all(env.client.get_run(r).state == RunState.COMPLETED for r in run_ids),
        60, "every run to complete",
    )  # fmt: skip
    sup.wait_ready(2)
    recycled = sup.sample("cyclone_worker_restarts_total", reason="recycle")
    assert recycled is not None and recycled >= 100  # 120 steps, one per worker process
    # The supervisor opens short-lived connections (gauges): wait for a quiet moment rather
    # than count at an instant. A leak per respawn (120 of them) never settles. Its kept
    # sessions may open after the count at start, and are allowed: the store's (the first
    # check for revoked leases), the LISTEN and presence sessions (reopened after an error),
    # and the dispatcher's (the first `want`).
    kept = 3 + SESSIONS
    settled = lambda: len(os.listdir(f"/proc/{sup.pid}/fd")) <= fds + kept  # noqa: E731
    wait_for(settled, 10, f"descriptors settled (at start {fds}, {kept} kept sessions allowed)")
    assert list(scratch.iterdir()) == []

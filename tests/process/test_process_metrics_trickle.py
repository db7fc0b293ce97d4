"""A client that trickles its `/metrics` request holds up nothing (issue 22, item 4): one byte
every 0.2 s for 20 s held a 3 s-timeout step for 21.7 s, and nothing was leased meanwhile."""

from __future__ import annotations

import socket
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from proc_flows import busy, timed
from proc_helpers import alive, completed, wait_for

pytestmark = pytest.mark.process


def trickle(port: int, stop: threading.Event, sent: list[int]) -> None:
    """One byte every 0.2 s of a request that never ends, reconnecting whenever cut off."""
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(b"GET /metrics HTTP/1.0\r\n")
                while not stop.wait(0.2):
                    conn.sendall(b"X")
                    sent[0] += 1
        except OSError:
            continue  # hung up on: again


def test_a_trickling_metrics_client_holds_up_no_kill_and_no_lease(env, supervisor, tmp_path):
    sup = supervisor(workers=2)
    port = urllib.parse.urlsplit(sup.metrics_url()).port
    stop, sent = threading.Event(), [0]
    trickler = threading.Thread(target=trickle, args=(port, stop, sent), daemon=True)
    trickler.start()
    try:
        wait_for(lambda: sent[0] >= 3, 5, "the trickle to start")
        run_id = env.client.submit(timed, {"dir": str(tmp_path)})  # a 1 s timeout
        note = Path(tmp_path) / f"{run_id}.1.pids"
        wait_for(note.exists, 10, "the step to start")
        worker = int(note.read_text().split()[0])
        started, trickled = note.stat().st_mtime, sent[0]
        # Meanwhile a plain run is leased and finished.
        plain = env.client.submit(busy, {"dir": str(tmp_path), "n": 1, "sleep": 0})
        wait_for(lambda: not alive(worker), 10, f"the kill\n{sup.log()}")
        # Its 1 s timeout, kill_grace, and polling slack: not the trickle's length.
        assert time.time() - started < 3.5, sup.log()
        wait_for(lambda: completed(env, plain), 5, "the plain run")
        assert sent[0] > trickled  # the trickle went on meanwhile
        assert "# HELP cyclone_steps_total" in sup.metrics()  # and scrapes are answered
    finally:
        stop.set()
        trickler.join(10)
    assert sup.popen.poll() is None, sup.log()

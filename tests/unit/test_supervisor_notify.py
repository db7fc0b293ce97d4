"""systemd's notify protocol, received on a fake notify socket (a path and an abstract one)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cyclone.notify import Notifier, notify, socket_address


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify.sock")
        sock.bind(name)
    else:
        name = f"@cyclone-test-{os.getpid()}-{id(sock)}"
        sock.bind("\0" + name[1:])
    sock.settimeout(5)
    yield name, sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    messages = []
    sock.setblocking(False)
    try:
        while True:
            messages.append(sock.recv(4096).decode())
    except BlockingIOError:
        return messages


def test_ready_status_and_stopping_arrive_in_order_and_only_once(notify_socket) -> None:
    name, sock = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": name})
    notifier.ready("2 idle workers")
    notifier.ready("again")  # READY=1 is sent once
    notifier.update("1 busy")
    notifier.update("1 busy")  # unchanged: not sent
    notifier.stopping()
    notifier.stopping()
    notifier.update("after stopping")  # nothing after STOPPING=1
    messages = received(sock)
    assert messages == [
        f"READY=1\nSTATUS=2 idle workers\nMAINPID={os.getpid()}",
        "STATUS=1 busy",
        "STOPPING=1\nSTATUS=draining",
    ]


def test_without_a_notify_socket_nothing_is_sent_and_nothing_fails(tmp_path: Path) -> None:
    assert not notify("READY=1", environ={})
    assert not notify("READY=1", environ={"NOTIFY_SOCKET": "vsock:2:1234"})
    # A socket that is gone (systemd restarted) is a warning, never an error of ours.
    assert not notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    Notifier({}).ready("x")


def test_abstract_socket_names_start_with_a_nul_byte() -> None:
    assert socket_address("@foo") == "\0foo"
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("") is None


def test_a_receiver_that_stopped_reading_never_blocks_the_sender(tmp_path: Path) -> None:
    path = str(tmp_path / "full.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sent = [notify(f"STATUS={n}", environ={"NOTIFY_SOCKET": path}) for n in range(2000)]
    # The queue filled up at some point; later messages were dropped, none waited.
    assert sent[0] and not all(sent)

"""systemd's notify protocol with the standard library alone (`Type=notify` units).

A datagram of newline-separated `KEY=VALUE` lines sent to the AF_UNIX socket named by
`$NOTIFY_SOCKET`: a path, or an abstract socket when it starts with "@" (systemd's own
self-contained example, man/notify-selfcontained-example.py, does the same). The protocol is
listed as stable by systemd. Without `$NOTIFY_SOCKET` (not under systemd) every call is a no-op.

The supervisor sends `READY=1` once its config, database, schema and metrics endpoint are up
and its first children are forked, `STATUS=...` as its workers change, and `STOPPING=1` when it
starts draining.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV = "NOTIFY_SOCKET"


def socket_address(value: str | None) -> str | None:
    """The address to send to, or None when there is none this module can use."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]  # Linux abstract namespace
    if value.startswith("/"):
        return value
    return None  # vsock:... addresses (VMs talking to a host) are not supported


def notify(*lines: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send `lines` as one datagram; True when it was sent. Never raises."""
    raw = (os.environ if environ is None else environ).get(ENV)
    address = socket_address(raw)
    if address is None:
        if raw:
            log.warning("%s=%r is not a socket path; not notifying systemd", ENV, raw)
        return False
    message = "\n".join(lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # Never wait: the caller is the supervisor's loop, and a receiver that stopped
            # reading (its queue full) would otherwise block it, and every kill with it.
            sock.setblocking(False)
            sock.connect(address)
            sock.send(message)
    except BlockingIOError:
        log.debug("the notify socket %s is full; dropped %r", raw, lines)
        return False
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", raw, exc)
        return False
    return True


class Notifier:
    """The supervisor's side: READY once, STOPPING once, STATUS only when it changed."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = environ
        self.enabled = bool((os.environ if environ is None else environ).get(ENV))
        self.ready_sent = False
        self.stopping_sent = False
        self.status = ""

    def send(self, *lines: str) -> None:
        if self.enabled:
            notify(*lines, environ=self.environ)

    def ready(self, status: str) -> None:
        if not self.ready_sent:
            self.ready_sent = True
            self.status = status
            self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def update(self, status: str) -> None:
        if status != self.status and not self.stopping_sent:
            self.status = status
            self.send(f"STATUS={status}")

    def stopping(self, status: str = "draining") -> None:
        if not self.stopping_sent:
            self.stopping_sent = True
            self.status = status
            self.send("STOPPING=1", f"STATUS={status}")

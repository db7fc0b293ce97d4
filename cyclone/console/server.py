"""The console's HTTP server: uvicorn, configured the one way `cyclone console` and the tests
run it (no Server header, no access log of URLs that may hold filter text, no proxy headers
trusted)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    """SIGTERM and SIGINT stop the server gracefully and the command exits 0: uvicorn's own
    handling raises the signal again once stopped, so a service manager would see a death by
    signal where the operator asked for a stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # a server in a thread (the tests) is stopped by should_exit
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(app: Any, host: str, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False,
        server_header=False, proxy_headers=False, lifespan="on",
    )  # fmt: skip
    return _Server(config)

"""The console's HTTP server: uvicorn, configured the one way `cyclone console` and the tests
run it (no Server header, no access log of URLs that may hold filter text, no proxy headers
trusted)."""

from __future__ import annotations

from typing import Any

import uvicorn


def make_server(app: Any, host: str, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False,
        server_header=False, proxy_headers=False, lifespan="on",
    )  # fmt: skip
    return uvicorn.Server(config)

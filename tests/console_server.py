"""The web console served on a free loopback port from a thread of the test process, and a
small HTTP client for it (cookies kept, redirects not followed). No tests here."""

from __future__ import annotations

import http.client
import http.cookies
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from html import unescape
from urllib.parse import urlencode

from cyclone.console import ConsoleSettings, create_app
from cyclone.console.server import make_server

TOKEN = "console-test-token-0123456789"


@contextmanager
def serve(dsn: str, **settings: object) -> Iterator[str]:
    """The console on 127.0.0.1:<free port>; yields its base URL."""
    app = create_app(ConsoleSettings(dsn=dsn, **settings))  # type: ignore[arg-type]
    server = make_server(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, name="console", daemon=True)
    thread.start()
    try:
        for _ in range(1000):
            if server.started or not thread.is_alive():
                break
            threading.Event().wait(0.01)
        assert server.started, "the console did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    text: str

    def problem(self) -> str:
        found = re.search(r'id="problem">([^<]*)<', self.text)
        return unescape(found.group(1)) if found else ""

    def field(self, name: str) -> str:
        found = re.search(rf'name="{name}" value="([^"]*)"', self.text)
        assert found, f"no field {name}"
        return unescape(found.group(1))


@dataclass
class Browser:
    """Just enough of a browser: cookies, a Host and an Origin it can be told to forge."""

    base: str
    cookies: dict[str, str] = field(default_factory=dict)

    def request(
        self, method: str, path: str, form: list[tuple[str, str]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:  # fmt: skip
        host, port = self.base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        sent = {"Host": f"{host}:{port}", **(headers or {})}
        if self.cookies:
            sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        body = None
        if form is not None:
            body = urlencode(form)
            sent["Content-Type"] = "application/x-www-form-urlencoded"
        conn.request(method, path, body=body, headers=sent)
        res = conn.getresponse()
        text = res.read().decode()
        for name, value in res.getheaders():
            if name.lower() == "set-cookie":
                jar = http.cookies.SimpleCookie(value)
                for key, morsel in jar.items():
                    if morsel["max-age"] == "0" or morsel.value == "":
                        self.cookies.pop(key, None)
                    else:
                        self.cookies[key] = morsel.value
        conn.close()
        return Answer(res.status, {k.lower(): v for k, v in res.getheaders()}, text)

    def get(self, path: str, **kw: object) -> Answer:
        return self.request("GET", path, **kw)  # type: ignore[arg-type]

    def post(self, path: str, form: list[tuple[str, str]], **kw: object) -> Answer:
        return self.request("POST", path, form=form, **kw)  # type: ignore[arg-type]

    def sign_in(self, token: str = TOKEN) -> Answer:
        nonce = self.get("/login").field("nonce")
        return self.post("/login", [("nonce", nonce), ("token", token), ("back", "/")])

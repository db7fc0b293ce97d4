"""Who may act, and proof that an action came from the console's own page.

Read-only unless `[console] token` is set. With a token, an operator signs in with it once
and gets a session cookie (HttpOnly, SameSite=Strict; Secure behind https). Every action is a
POST that must carry the session's CSRF token, an HMAC of the session under a key made at
start-up and never shown, and, where the browser sends one, an Origin of this console. The
sign-in form itself carries a token of its own (a double-submit cookie), so another site
cannot sign a browser in either. Sessions live in this process's memory: a restart signs
everyone out.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from urllib.parse import urlsplit

SESSION_COOKIE = "cyclone_console_session"
LOGIN_COOKIE = "cyclone_console_login"
SESSION_TTL = 12 * 3600.0
MAX_SESSIONS = 1000

# Addresses whose Host header is checked: a console on loopback answers only to loopback
# names, so a page of another site that rebinds its DNS name to 127.0.0.1 reads nothing.
LOOPBACK_BINDS = {"127.0.0.1", "localhost", "::1"}
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}

SECURITY_HEADERS = {
    # No script, style or frame from anywhere but the console itself; nothing inline.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
        "object-src 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" makes a form's Origin "null"
    "Cache-Control": "no-store",
}


class Guard:
    def __init__(self, token: str | None) -> None:
        self._token = token
        self._key = secrets.token_bytes(32)
        self._sessions: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def actions(self) -> bool:
        """Whether actions exist at all (a token is configured)."""
        return self._token is not None

    def check_token(self, given: str) -> bool:
        if self._token is None:
            return False
        return hmac.compare_digest(given.encode(), self._token.encode())

    def new_session(self) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[sid] = time.monotonic() + SESSION_TTL
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return sid

    def end_session(self, sid: str | None) -> None:
        with self._lock:
            self._sessions.pop(sid or "", None)

    def signed_in(self, sid: str | None) -> bool:
        if not sid or self._token is None:
            return False
        with self._lock:
            until = self._sessions.get(sid)
            if until is None:
                return False
            if until < time.monotonic():
                del self._sessions[sid]
                return False
            return True

    def csrf(self, sid: str) -> str:
        return hmac.new(self._key, f"csrf:{sid}".encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, sid: str | None, given: str | None) -> bool:
        if not sid or not given:
            return False
        return hmac.compare_digest(self.csrf(sid), given)


def same_origin(origin: str | None, host: str | None) -> bool:
    """An Origin header (when the browser sent one) names this console's host."""
    if origin is None:
        return True  # old browsers and scripts; the CSRF token still has to match
    if origin == "null" or host is None:
        return False
    return urlsplit(origin).netloc.lower() == host.lower()


def host_allowed(bind: str, host_header: str | None) -> bool:
    if bind not in LOOPBACK_BINDS:
        return True  # behind the operator's proxy, which names the host
    if not host_header:
        return False
    host = host_header.lower()
    if host.startswith("["):
        name = host.split("]")[0] + "]"
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name in LOOPBACK_HOSTS

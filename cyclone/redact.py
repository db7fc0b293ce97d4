"""Keeping passwords out of messages: a DSN's, and any value quoted back to an operator.

Config errors, the CLI's messages and the logs show DSNs and values an operator typed;
everything they quote goes through `redact_dsn` (or `show_value`, which calls it).
"""

from __future__ import annotations

import json
import re

URL_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*://", re.IGNORECASE)
# Greedy up to the last "@": a raw "@" or "/" in a password must not end the match early.
_URL_PASSWORD = re.compile("(" + URL_SCHEME.pattern + r"[^:/?#@]*:).*@", re.IGNORECASE | re.DOTALL)
# A libpq keyword value: quoted (with \-escapes, maybe unterminated) or up to whitespace, which
# for libpq is ASCII only: a no-break space is part of the password, so re.ASCII.
_KV_PASSWORD = re.compile(
    r"(password\s*=\s*)(?:'(?:[^'\\]|\\.?)*(?:'|$)|\S+)", re.IGNORECASE | re.ASCII | re.DOTALL
)


def redact_dsn(url: str) -> str:
    """`url` with any password replaced by `***`, in URL and key=value form alike."""
    url = _URL_PASSWORD.sub(r"\1***@", url)
    return _KV_PASSWORD.sub(r"\1***", url)


def show_value(value: object) -> str:
    """A value as it would look in TOML, redacted, on one line, and short."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(redact_dsn(value), ensure_ascii=False)
    elif isinstance(value, list | tuple):
        text = "[" + ", ".join(show_value(v) for v in value) + "]"
    elif isinstance(value, dict):
        text = "a table"
    else:
        text = redact_dsn(str(value))
    return text if len(text) <= 80 else text[:77] + "..."

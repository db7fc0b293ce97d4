"""Keeping passwords out of messages: a DSN's, and any value quoted back to an operator.

Config errors, the CLI's messages and the logs show DSNs and values an operator typed;
everything they quote goes through `redact_dsn` (or `show_value`, which calls it).

An error about a connection may also quote pieces of the password without any DSN around
them: a URL with a raw "@" or "/" in its password is read by libpq with part of the password
as the host, port or database name, and libpq and the server name those back. `redact_error`
(one line) and `redact_secrets` (the supervisor's log filter, cyclone/sanitize.py) hide them,
given the DSN: its password, and the raw text where the password was written.
"""

from __future__ import annotations

import functools
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
    # The substring tests first: every log line comes through here, and seldom holds either.
    if "://" in url:
        url = _URL_PASSWORD.sub(r"\1***@", url)
    if "password" in url.lower():
        url = _KV_PASSWORD.sub(r"\1***", url)
    return url


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


# libpq and the server quote the values they complain about: "s3cr%zzet", "ss@host".
_QUOTED = re.compile(r"\"([^\"]*)\"|'([^']*)'")
# A quoted value that begins with this many characters that end a password (or the reverse)
# is taken as a piece of it: a misread DSN splits the password where a host or port begins.
_PIECE = 2


@functools.cache
def _kv_raw() -> re.Pattern[str]:
    """A key=value DSN's password as written: quoted, or all up to the next libpq keyword
    (libpq stops at a space and complains about the rest: `password=my secret` gives
    `missing "=" after "secret"`, and `password=a b=c` an invalid option "b")."""
    from psycopg import pq

    keywords = "|".join(re.escape(d.keyword.decode()) for d in pq.Conninfo.get_defaults())
    return re.compile(
        rf"password\s*=\s*('(?:[^'\\]|\\.)*'?|.*?)(?=\s+(?:{keywords})\s*=|\s*$)",
        re.IGNORECASE | re.ASCII | re.DOTALL,
    )


def secrets_of(dsn: str | None) -> list[str]:
    """See `_secrets_of`; a copy (that one is cached: the log filter asks for every line)."""
    return list(_secrets_of(dsn)) if dsn else []


@functools.lru_cache(maxsize=16)
def _secrets_of(dsn: str) -> tuple[str, ...]:
    """What of `dsn` must never be shown: its password as parsed, and, for a DSN libpq reads
    differently than its author meant (a raw "@" or "/" in the password), the raw text where
    the password was written, which may end up in a host, port or database name."""
    from urllib.parse import unquote

    found = []
    try:
        from psycopg.conninfo import conninfo_to_dict

        password = conninfo_to_dict(dsn).get("password")
    except Exception:  # unparseable: the raw regions below still apply
        password = None
    if password:
        found.append(str(password))
    scheme = URL_SCHEME.match(dsn.lstrip())
    if scheme:
        rest = dsn.lstrip()[scheme.end() :]
        userinfo = rest.rpartition("@")[0]
        if ":" in userinfo:
            raw = userinfo.partition(":")[2]
            found += [raw, unquote(raw)]
    else:
        for match in _kv_raw().finditer(dsn):
            raw = match.group(1)
            found += [raw, raw.strip("'")]
    return tuple(s for s in dict.fromkeys(found) if s)


def _overlaps(token: str, secret: str) -> bool:
    """Whether `token` holds a piece of `secret` as a misread DSN cuts it: all of it, inside
    it, or an end of it where the token begins or ends ("ss@host" from "p@ss")."""
    if not token:
        return False
    # A one-character token ("@") tells nothing, and a password of a character or two (or one
    # libpq cut short) would otherwise hide every token that holds that letter.
    if (len(token) >= _PIECE and token in secret) or token == secret:
        return True
    if len(secret) >= _RUN and secret in token:
        return True
    shortest = min(_PIECE, len(secret))
    return any(
        token.startswith(secret[-n:]) or token.endswith(secret[:n])
        for n in range(shortest, min(len(token), len(secret)) + 1)
    )


def redact_error(text: str, dsn: str | None) -> str:
    """An error message about connecting to `dsn` on one line, with no piece of its password
    (see `redact_secrets`)."""
    return " ".join(redact_secrets(str(text), dsn).split())


def redact_secrets(text: str, dsn: str | None) -> str:
    """`text` with any DSN's password, and every piece of `dsn`'s, replaced by `***`: for a
    DSN libpq reads differently than its author meant, libpq and the server quote pieces of
    the password back as a host, a port, a database name or a bad token."""
    text = redact_dsn(text)
    secrets = sorted(secrets_of(dsn), key=len, reverse=True)  # "p@ss" before its piece "p"
    if not secrets:
        return text

    def hide(match: re.Match[str]) -> str:
        token = match.group(1) if match.group(1) is not None else match.group(2)
        return '"***"' if any(_overlaps(token, s) for s in secrets) else match.group(0)

    # The quoted pieces first, while they are whole (a host "ss@h" cut from "p@ss"); then
    # any run of the password's characters, wherever it stands and however it is quoted.
    text = _QUOTED.sub(hide, text)
    for secret in secrets:
        text = _hide_runs(text, secret)
    return text


# A run of at least this many characters of a password that begins or ends where a value
# does (a quote, a space, "@", "/", ...: where a misread DSN cuts it) is taken as a piece of
# it; inside a word it is not ("nter" of "hunter2" in "db.internal").
_RUN = 4
_EDGES = frozenset(" \t\"'@/:?#=,;()[]{}<>")


@functools.lru_cache(maxsize=64)
def _grams(secret: str) -> re.Pattern[str]:
    size = min(_RUN, len(secret))
    return re.compile(
        "|".join(re.escape(secret[i : i + size]) for i in range(len(secret) - size + 1))
    )


def _hide_runs(text: str, secret: str) -> str:
    # One search in C for the common case of no hit: this runs on every log line.
    grams = _grams(secret)
    out, start = [], 0
    for match in grams.finditer(text):
        if match.start() < start:
            continue  # inside a run already hidden
        left, right = match.start(), match.end()
        while left > start and text[left - 1 : right] in secret:
            left -= 1
        while right < len(text) and text[left : right + 1] in secret:
            right += 1
        whole = text[left:right] == secret
        edge_left = left == 0 or text[left - 1] in _EDGES
        edge_right = right == len(text) or text[right] in _EDGES
        if len(secret) < _RUN:
            hide = whole and edge_left and edge_right  # a short one only as a word of its own
        else:
            hide = whole or edge_left or edge_right
        if not hide:
            continue
        out += [text[start:left], "***"]
        start = right
    return "".join(out) + text[start:] if out else text

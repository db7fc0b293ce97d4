"""Connections, JSON payloads and the retry of transactions that lost a deadlock race."""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

# Payloads live in rows that every lease and listing reads: keep them small by default.
MAX_PAYLOAD_BYTES = 1024 * 1024
# Deadlocks between a child run finishing (child, then parent) and its parent being cancelled
# (parent, then children) are rare and resolved by PostgreSQL aborting one side: retry it.
_RETRIES = 5

T = TypeVar("T")

# psycopg prepares a statement on the server after its fifth execution. Behind a pooler in
# transaction mode (PgBouncer before 1.21, or without max_prepared_statements) the next
# transaction may run on another server connection, which has no such statement, or already
# one of that name: "prepared statement "_pg3_0" does not exist". None turns preparing off.
# `[database] prepared_statements` sets it in the supervisor before it forks its children.
_PREPARE_THRESHOLD: int | None = 5


def use_prepared_statements(enabled: bool) -> None:
    """Whether connections made from now on in this process (and its forks) may prepare."""
    global _PREPARE_THRESHOLD
    _PREPARE_THRESHOLD = 5 if enabled else None


def prepare_threshold() -> int | None:
    """psycopg's prepare_threshold for a new connection, as use_prepared_statements set it."""
    return _PREPARE_THRESHOLD


def resolve_dsn(
    dsn: str | None,
    embedded_dir: str | None = None,
    announce: Callable[[str], None] | None = None,
    reused: Callable[[str], None] | None = None,
) -> str:
    """The DSN to use: the one given, else CYCLONE_DATABASE_URL, else the embedded server,
    started (or created, which `announce` reports) in `embedded.data_dir(embedded_dir)`;
    `reused` is told when a server already running there is used."""
    if dsn:
        return dsn
    env = os.environ.get("CYCLONE_DATABASE_URL")
    if env:
        return env
    from cyclone import embedded

    where = embedded.data_dir(embedded_dir)
    if announce is None:
        return embedded.ensure_server(where, reused=reused)
    return embedded.ensure_server(where, announce=announce, reused=reused)


# The values libpq accepts for the options that take one of a few words: a value outside them
# fails every connection ("invalid sslmode value"), which is a configuration mistake, not an
# unreachable database.
_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "sslnegotiation": ("postgres", "direct"),
    "sslcertmode": ("disable", "allow", "require"),
    "load_balance_hosts": ("disable", "random"),
    "target_session_attrs": (
        "any", "read-write", "read-only", "primary", "standby", "prefer-standby",
    ),
}  # fmt: skip
_URL_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*)://")


def check_dsn(dsn: str, *, syntax: bool = True) -> None:
    """Raise ConfigError, in one line without the password, if libpq would refuse `dsn`
    before trying to connect: another database's URL, bad syntax (unless `syntax` is false),
    a value out of range."""
    from cyclone.errors import ConfigError
    from cyclone.redact import redact_error

    scheme = _URL_SCHEME.match(dsn)
    if scheme and scheme.group(1).lower() not in ("postgresql", "postgres"):
        raise ConfigError(
            f"not a PostgreSQL URL (it starts with {scheme.group(1)}://): Cyclone needs a "
            'PostgreSQL server, named by a "postgresql://" URL or by key=value pairs'
        )
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        if not syntax:
            return
        hint = _PERCENT_HINT if "percent-encoded" in str(exc) else ""
        text = redact_error(str(exc), dsn)
        raise ConfigError(f"not a usable database URL: {text}{hint}") from None
    except UnicodeDecodeError:
        if not syntax:
            return
        # An escape such as %80 that libpq decodes to bytes that are not UTF-8; the message
        # names no part of the URL: the escape may sit in the password.
        raise ConfigError(
            "not a usable database URL: a percent-escape in it is not UTF-8 text"
            f"{_PERCENT_HINT}"
        ) from None
    if syntax:
        _check_misread(params, url=scheme is not None)
    for key, allowed in _CHOICES.items():
        value = params.get(key)
        if value is not None and value not in allowed:
            # The value is not shown: in a URL mangled by a raw "/" or "?" in the password,
            # it may be part of the password.
            raise ConfigError(
                f"{key}: not a value PostgreSQL accepts (one of {', '.join(allowed)})"
            )


_PERCENT_HINT = ': a "%" in a URL starts an escape; write a "%" in the password as %25'
_PORTS = re.compile(r"[0-9]*(,[0-9]*)*", re.ASCII)


def _check_misread(params: dict[str, Any], *, url: bool) -> None:
    """Refuse a DSN that libpq reads differently than its author meant: a raw "@" or "/" in a
    URL's password moves part of it into the host, port or database name, where every failed
    connection would quote it back. No value is shown: it may be part of the password."""
    from cyclone.errors import ConfigError

    escape = ' (in a URL, write "@" in the password as %40 and "/" as %2F)' if url else ""
    if not _PORTS.fullmatch(str(params.get("port") or "")):
        raise ConfigError(f"port: not a number{escape}")
    if url and "@" in str(params.get("host") or "") + str(params.get("dbname") or ""):
        raise ConfigError(f'the host or database name holds an "@"{escape}')


def unreachable(exc: psycopg.Error) -> bool:
    """Whether `exc` says the database could not be reached or went away (no connection, a
    broken one, a server shutting down), rather than that it refused a statement. By SQLSTATE:
    psycopg's classes do not say it (SerializationFailure is an OperationalError, and not a
    TransactionRollback)."""
    state = exc.sqlstate or ""
    if not state:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith(("08", "57P"))


def connect(dsn: str, name: str = "cyclone", **kwargs: Any) -> psycopg.Connection[dict[str, Any]]:
    """An autocommit connection with dict rows: every write runs in an explicit transaction.

    `name` is the session's application_name in pg_stat_activity (unless the DSN sets one), so
    an operator can tell a worker's session from the scanner's or the supervisor's.
    """
    kwargs.setdefault("prepare_threshold", _PREPARE_THRESHOLD)
    return psycopg.connect(
        dsn, autocommit=True, row_factory=dict_row, fallback_application_name=name, **kwargs
    )


# The server options of the sessions that run the hot path (the dispatcher's, the workers',
# the scanner's). plan_cache_mode plans each prepared statement once: the plan cache otherwise
# compares the first custom plans with the generic one and may keep planning anew at every
# execution (a statement of a dozen CTEs costs more to plan than to run). A plan made once must
# not hang on the tables' size when it was made: on a fresh install the supervisor plans while
# the tables are empty and never analyzed, and the burst that follows was walked by sequential
# scans (of the steps and runs, for each dispatch) until autovacuum analyzed them and the plans
# were made again, a minute on. enable_seqscan off leaves the planner the indexes each
# statement is written for, whatever its estimates. tests/db/test_plans.py holds every
# statement to the same bounds in such a plan, as in the generic and custom plans of four
# states of the statistics.
HOT_PLANS = "-c plan_cache_mode=force_generic_plan -c enable_seqscan=off"


def with_options(dsn: str, options: str) -> str:
    """The DSN with server `options` added to any it has (a search_path, say)."""
    if not options:
        return dsn
    params = conninfo_to_dict(dsn)
    params["options"] = f"{params.get('options') or ''} {options}".strip()
    return make_conninfo(**params)  # type: ignore[arg-type]


# How deep arrays and objects may nest in a payload (input, signal, output, map item). Python's
# json module, and so every process that reads a payload back (the supervisor's dispatcher,
# a worker's lease), decodes by recursion: an input nested ~990 deep raised RecursionError in
# the supervisor's loop at every restart. Well below that, and above any sane document.
MAX_JSON_DEPTH = 100


def check_json(value: Any, what: str = "value") -> None:
    """Raise TypeError naming the first part of `value` that is not plain JSON, or
    PayloadTooDeep when arrays and objects nest deeper than MAX_JSON_DEPTH. Without recursion,
    so that no depth can make the check itself fail."""
    from cyclone.errors import PayloadTooDeep

    # (value, depth of its container, parent entry, key in the parent): the path to a part is
    # spelled out only when it is wrong.
    stack: list[tuple[Any, int, Any, Any]] = [(value, 0, None, None)]
    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[1]
        if item is None or isinstance(item, bool | int | str):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise TypeError(f"{_path(what, entry)}: {item!r} is not JSON (no NaN or infinity)")
            continue
        if isinstance(item, list | tuple | dict) and depth >= MAX_JSON_DEPTH:
            raise PayloadTooDeep(
                f"{what}: arrays and objects nested more than {MAX_JSON_DEPTH} levels deep "
                f"(the limit is {MAX_JSON_DEPTH})"
            )
        if isinstance(item, list | tuple):
            stack.extend((v, depth + 1, entry, i) for i, v in reversed(list(enumerate(item))))
            continue
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    raise TypeError(
                        f"{_path(what, entry)}: key {key!r} is not a string, so this is not JSON"
                    )
            stack.extend((v, depth + 1, entry, k) for k, v in reversed(list(item.items())))
            continue
        raise TypeError(f"{_path(what, entry)}: {type(item).__name__} is not JSON")


def _path(what: str, entry: tuple[Any, int, Any, Any]) -> str:
    """`what[0]['key']...`: where the part of check_json's stack entry sits in the value."""
    keys = []
    while entry[2] is not None:
        keys.append(f"[{entry[3]!r}]" if isinstance(entry[3], str) else f"[{entry[3]}]")
        entry = entry[2]
    return what + "".join(reversed(keys))


_BLANK = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


def loads_flat(text: str) -> Any:
    """json.loads without recursion, for a document nested too deep for json (which recurses
    once a level): the supervisor's dispatcher reads a batch with a row written past the
    client's checks this way, to hand out its other leases. ValueError if it is not JSON."""
    from json.decoder import scanstring

    def blank(i: int) -> int:
        return _BLANK.match(text, i).end()  # type: ignore[union-attr] - always matches

    def key(i: int) -> tuple[str, int]:
        if text[i : i + 1] != '"':
            raise ValueError(f"not JSON: expected a key at {i}")
        name, i = scanstring(text, i + 1)
        i = blank(i)
        if text[i : i + 1] != ":":
            raise ValueError(f"not JSON: expected ':' at {i}")
        return name, blank(i + 1)

    stack: list[list[Any]] = []  # the open containers, each with the key its next value takes
    i = blank(0)
    while True:
        ch = text[i : i + 1]
        value: Any
        if ch in ("{", "["):
            i = blank(i + 1)
            if text[i : i + 1] == ("}" if ch == "{" else "]"):
                value, i = ({} if ch == "{" else []), i + 1
            elif ch == "{":
                name, i = key(i)
                stack.append([{}, name])
                continue
            else:
                stack.append([[], None])
                continue
        elif ch == '"':
            value, i = scanstring(text, i + 1)
        elif (number := _NUMBER.match(text, i)) is not None:
            fraction, exponent = number.groups()
            value = float(number[0]) if fraction or exponent else int(number[0])
            i = number.end()
        elif text.startswith("true", i):
            value, i = True, i + 4
        elif text.startswith("false", i):
            value, i = False, i + 5
        elif text.startswith("null", i):
            value, i = None, i + 4
        else:
            raise ValueError(f"not JSON: unexpected {ch!r} at {i}")
        # A whole value: into its container, closing each container that ends here.
        while True:
            i = blank(i)
            if not stack:
                if i != len(text):
                    raise ValueError(f"not JSON: extra data at {i}")
                return value
            top = stack[-1]
            if isinstance(top[0], list):
                top[0].append(value)
            else:
                top[0][top[1]] = value
            ch = text[i : i + 1]
            if ch == ",":
                i = blank(i + 1)
                if isinstance(top[0], dict):
                    top[1], i = key(i)
                break
            if ch != ("]" if isinstance(top[0], list) else "}"):
                raise ValueError(f"not JSON: unexpected {ch!r} at {i}")
            value, i = stack.pop()[0], i + 1


def encode_json(value: Any, what: str = "value", limit: int = MAX_PAYLOAD_BYTES) -> str:
    """JSON text for a jsonb parameter; TypeError if not JSON, PayloadTooLarge if too big (or
    PayloadTooDeep, nested too deep)."""
    from cyclone.errors import PayloadTooLarge

    if value is None and limit >= 4:
        return "null"  # what a handler that returns nothing gives, every step of it
    check_json(value, what)
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        size = len(text.encode())
    except (ValueError, UnicodeEncodeError) as exc:  # huge ints, lone surrogates
        raise TypeError(f"{what}: cannot be stored as JSON ({exc})") from None
    if "\\u0000" in text:
        raise TypeError(f"{what}: contains a NUL character, which PostgreSQL cannot store")
    if size > limit:
        raise PayloadTooLarge(too_large(what, f"{size} bytes", limit))
    return text


def too_large(what: str, size: str, limit: int = MAX_PAYLOAD_BYTES) -> str:
    """The one message for a payload over its limit, wherever it is found (the client's encode,
    the CLI's read of @FILE or stdin): `size` says how large it is, as far as it was read."""
    shown = f"{limit // 2**20} MiB ({limit} bytes)" if limit % 2**20 == 0 else f"{limit} bytes"
    return f"{what}: {size} of JSON, over the payload limit of {shown}"


# One cursor per connection for the statements of every step (a lease, a completion with the
# next lease). psycopg sets a new cursor up, adapters and all, for every conn.execute, which
# showed in a worker's CPU (see bench/README.md, "Figures behind the code's comments"). Used
# only by the thread that leases and completes; the lease keeper's heartbeats take cursors of
# their own. It is kept on the connection itself: a cursor holds its connection, so a table of
# them would keep every connection alive, while this reference cycle goes with the connection.
_STEP_CURSOR = "_cyclone_step_cursor"


def step_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """The connection's reused cursor for per-step statements (see above)."""
    cursor: psycopg.Cursor[Any] | None = getattr(conn, _STEP_CURSOR, None)
    if cursor is None or cursor.closed:
        cursor = conn.cursor()
        setattr(conn, _STEP_CURSOR, cursor)
    return cursor


@functools.lru_cache(maxsize=64)
def text_array(values: tuple[str, ...]) -> str:
    """A text[] literal of `values`, for a parameter cast with ::text[].

    psycopg adapts a list parameter element by element, on every execution: for the names a
    worker leases for, once a step (see bench/README.md, "Figures behind the code's
    comments"). The names do not change, so their literal is made once.
    """
    quoted = (v.replace("\\", "\\\\").replace('"', '\\"') for v in values)
    return "{" + ",".join(f'"{v}"' for v in quoted) + "}"


def retrying(fn: Callable[[], T]) -> T:
    """Run `fn` (one whole transaction) again when PostgreSQL aborted it to break a deadlock."""
    for attempt in range(_RETRIES):
        try:
            return fn()
        except (pg_errors.DeadlockDetected, pg_errors.SerializationFailure):
            if attempt == _RETRIES - 1:
                raise
    raise AssertionError("unreachable")


def check_text(value: str, what: str) -> None:
    """Names and keys are stored as text: PostgreSQL cannot store a NUL character in them."""
    if "\x00" in value:
        raise ValueError(f"{what}: contains a NUL character")


def is_step_id(value: object) -> bool:
    """Whether `value` can name a step: a whole number (not a bool) in a bigint's positive range."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**63

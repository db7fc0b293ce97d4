"""What every command shares: the database session, exit codes, argument types and output.

Data goes to stdout (a rich table, or JSON with `--json`); messages go to stderr as plain
lines. rich draws no ANSI codes when stdout is not a terminal and honours NO_COLOR and
TERM=dumb. Every message that could show a DSN goes through `redact`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
import uuid
from argparse import ArgumentTypeError
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import psycopg

from cyclone.clients.client import Client
from cyclone.config import ENV_DATABASE_URL, load_config
from cyclone.db import (
    MAX_PAYLOAD_BYTES,
    check_dsn,
    connect,
    is_step_id,
    resolve_dsn,
    too_large,
    with_options,
)
from cyclone.display import Shown
from cyclone.durations import parse_duration
from cyclone.errors import ConfigError
from cyclone.redact import redact_dsn, redact_error
from cyclone.sanitize import printable
from cyclone.sql import QUERIES

# Exit statuses (docs/cli.md, "Exit status").
OK, REFUSED, USAGE, UNREACHABLE = 0, 1, 2, 3
# `run --wait --timeout` when the run is still going: timeout(1)'s status, not 1 (which says
# the run failed or was cancelled).
TIMED_OUT = 124
CONNECT_TIMEOUT = 5
# Every statement the CLI runs is bounded; status uses a shorter bound (it refreshes).
STATEMENT_TIMEOUT_MS = 10_000
MAX_LIMIT = 10_000
_UUID = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}", re.I | re.A)
_STEP_ID = re.compile(r"[0-9]{1,19}", re.ASCII)


class CliError(Exception):
    """A failure with its exit status and a one-line message for stderr."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


PREFIX = "cyclone: "


def message(text: str) -> None:
    """One line for the operator on stderr. Every message carries the `cyclone:` prefix, once,
    so a script's log tells them from its own and from the data on stdout."""
    text = text if text.startswith(PREFIX) else PREFIX + text
    # One line, whatever a name or an error it quotes holds (control characters escaped).
    print(printable(text), file=sys.stderr, flush=True)


# --- the database session -------------------------------------------------------------------


class SessionClient(Client):
    """A Client on the one connection the command opened, so a dead database fails fast."""

    def __init__(self, conn: psycopg.Connection[Any], dsn: str) -> None:
        super().__init__(dsn)
        self._session = conn

    @contextmanager
    def connection(self, conn: Any = None) -> Iterator[Any]:
        yield self._session


def reads_replica(parser: argparse.ArgumentParser) -> None:
    """A command that only reads: it takes --read-dsn, and goes to the read replica (that,
    else [database] read_url) when there is one."""
    parser.add_argument(
        "--read-dsn", metavar="URL", default=argparse.SUPPRESS,
        help="a read replica's URL (else the config's [database] read_url; else the primary)",
    )  # fmt: skip
    parser.set_defaults(reads=True)


class Session:
    """The command's database: the DSN resolved once, one connection opened on first use."""

    def __init__(
        self,
        dsn: str | None,
        config: str | None,
        statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
        start_embedded: bool = False,
        read_dsn: str | None = None,
        reads: bool = False,
    ) -> None:
        self._dsn_arg = dsn
        self._read_dsn_arg = read_dsn
        # A command that only reads: it goes to the read replica when one is given.
        self.reads = reads
        self._config = config
        self.statement_timeout_ms = statement_timeout_ms
        # Only commands that set the database up (migrate, embedded start) may create or start
        # the embedded server; the others look for a running one and say what to do if none.
        self.start_embedded = start_embedded
        self._dsn: str | None = None
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def dsn_known(self) -> bool:
        return self._dsn is not None

    @property
    def dsn(self) -> str:
        if self._dsn is None:
            self._dsn = self._resolve()
        return self._dsn

    def _resolve(self) -> str:
        if self.reads:
            replica = self._read_replica()
            if replica is not None:
                return replica
        return self._resolve_primary()

    def _read_replica(self) -> str | None:
        # --read-dsn, else the config's database.read_url; none: the primary.
        if self._read_dsn_arg is not None:
            dsn, origin = self._read_dsn_arg, "--read-dsn"
        elif self._config is not None:
            dsn, origin = load_config(self._config).database.read_url, self._config
        else:
            return None
        if dsn is None:
            return None
        try:
            check_dsn(dsn)
        except ConfigError as exc:
            raise CliError(USAGE, f"{origin}: {exc}") from None
        return dsn

    def _resolve_primary(self) -> str:
        # --dsn, else the config's database.url (which CYCLONE_DATABASE_URL overrides, as it
        # does for the supervisor reading the same file), else CYCLONE_DATABASE_URL, else the
        # embedded server.
        embedded_dir = None
        if self._dsn_arg is not None:
            dsn, origin = self._dsn_arg, "--dsn"
        elif self._config is not None:
            database = load_config(self._config).database
            dsn, origin, embedded_dir = database.url, self._config, database.embedded_dir
        else:
            dsn, origin = os.environ.get(ENV_DATABASE_URL) or None, ENV_DATABASE_URL
        if dsn is None:
            return self._embedded(embedded_dir)
        try:
            check_dsn(dsn)
        except ConfigError as exc:
            # check_dsn's messages quote nothing of the password already: redacting them
            # again would hide their own words (a password "p" in "password").
            raise CliError(USAGE, f"{origin}: {exc}") from None
        return dsn

    @property
    def config(self) -> str | None:
        return self._config

    def embedded_dir(self) -> Path:
        """Where the embedded server of this command's config (or the default one) lives."""
        from cyclone import embedded

        configured = load_config(self._config).database.embedded_dir if self._config else None
        return embedded.data_dir(configured)

    def _embedded(self, embedded_dir: str | None) -> str:
        from cyclone import embedded

        if self.start_embedded:
            return resolve_dsn(None, embedded_dir)
        try:
            return embedded.running_dsn(embedded.data_dir(embedded_dir))
        except embedded.NotRunning as exc:
            raise CliError(UNREACHABLE, str(exc)) from None

    def connect(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = None
            dsn = self.dsn
            options = ""
            if self.statement_timeout_ms:
                options = f"-c statement_timeout={self.statement_timeout_ms}"
            try:
                # Never prepared: a command runs each statement a few times at most, and its
                # database may be behind a transaction-mode pooler, where a prepared statement
                # is lost with the transaction's server connection (`status` refreshes forever).
                self._conn = connect(
                    with_options(dsn, options), "cyclone-cli", connect_timeout=CONNECT_TIMEOUT,
                    prepare_threshold=None,
                )  # fmt: skip
            except psycopg.OperationalError as exc:
                raise CliError(
                    UNREACHABLE,
                    f"cannot reach the database at {redact_dsn(dsn)}: {redact(dsn, str(exc))}",
                ) from None
        return self._conn

    def client(self) -> Client:
        return SessionClient(self.connect(), self.dsn)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def redact(dsn: str, text: str) -> str:
    """`text` with the DSN's password removed, however the server or libpq quoted it."""
    return redact_error(text, dsn)


# --- argument types -------------------------------------------------------------------------


def run_id_arg(value: str) -> str:
    if not _UUID.fullmatch(value):
        raise ArgumentTypeError(f"not a run id (a UUID): {_show(value)}")
    return str(uuid.UUID(value))


def step_id_arg(value: str) -> int:
    if not _STEP_ID.fullmatch(value) or not is_step_id(int(value)):
        raise ArgumentTypeError(f"not a step id (a positive whole number): {_show(value)}")
    return int(value)


def text_arg(value: str) -> str:
    """A name or filter value: any text PostgreSQL can store (it is always a parameter)."""
    if "\x00" in value:
        raise ArgumentTypeError(f"contains a NUL character: {_show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ArgumentTypeError(f"not valid text: {_show(value)}") from None
    return value


def role_arg(value: str) -> str:
    """A PostgreSQL role name: printed into SQL (quoted) and into its comment lines, where a
    line break would end the comment and make the rest a statement."""
    text_arg(value)
    if not value or any(ch < " " or ch == "\x7f" for ch in value):
        raise ArgumentTypeError(f"not a role name (empty, or a control character): {_show(value)}")
    if len(value.encode()) > 63:
        raise ArgumentTypeError(f"not a role name (over 63 bytes): {_show(value)}")
    return value


def duration_arg(value: str) -> float:
    try:
        return parse_duration(value)
    except (ValueError, ArithmeticError) as exc:
        raise ArgumentTypeError(str(exc)) from None


def positive_duration_arg(value: str) -> float:
    seconds = duration_arg(value)
    if seconds <= 0:
        raise ArgumentTypeError(f"must be longer than zero: {_show(value)}")
    return seconds


def limit_arg(value: str) -> int:
    if not re.fullmatch(r"[0-9]{1,6}", value, re.ASCII) or not 1 <= int(value) <= MAX_LIMIT:
        raise ArgumentTypeError(f"expected a whole number from 1 to {MAX_LIMIT}: {_show(value)}")
    return int(value)


def priority_arg(value: str) -> int:
    if not re.fullmatch(r"[1-5]", value, re.ASCII):
        raise ArgumentTypeError(f"expected a whole number from 1 (first) to 5: {_show(value)}")
    return int(value)


def json_arg(value: str) -> Any:
    """JSON given inline, as `@FILE` (the file's content) or as `-` (read from stdin). Neither
    form is ambiguous: no JSON text starts with `@` or is a lone `-`."""
    origin = ""
    if value == "-":
        origin, value = "stdin: ", _read_stdin()
    elif value.startswith("@"):
        origin, value = f"{_show(value[1:], 300)}: ", _read_file(value[1:])
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise ArgumentTypeError(f"{origin}not JSON: {exc}") from None


# The client refuses a payload over MAX_PAYLOAD_BYTES once encoded (compact: a pretty-printed
# file may be larger); this only keeps a huge file (or an endless pipe) from being read into
# memory to find that out. Either way the message is the payload limit's (db.too_large).
_READ_LIMIT = 16 * MAX_PAYLOAD_BYTES


def _read_file(path: str) -> str:
    if not path:
        raise ArgumentTypeError("expected @FILE: a file name after the @")
    try:
        with open(path, "rb") as f:
            data = f.read(_READ_LIMIT + 1)
    except OSError as exc:
        raise ArgumentTypeError(f"cannot read {_show(path, 300)}: {exc.strerror or exc}") from None
    return _decode(data, _show(path, 300))


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.closed:
        raise ArgumentTypeError("stdin: nothing to read")
    if sys.stdin.isatty():
        message("reading JSON from stdin: end it with Ctrl-D")
    return _decode(sys.stdin.buffer.read(_READ_LIMIT + 1), "stdin")


def _decode(data: bytes, origin: str) -> str:
    if len(data) > _READ_LIMIT:
        raise ArgumentTypeError(too_large(origin, f"more than {_READ_LIMIT} bytes"))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ArgumentTypeError(f"{origin}: not UTF-8 text") from None


def _show(value: str, most: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


# --- output ---------------------------------------------------------------------------------


def console() -> Any:
    """A rich console on the current stdout (tests swap it): colour only on a terminal."""
    from rich.console import Console

    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
    # No markup: every string printed is data (names, errors), never a style to obey.
    return Console(file=sys.stdout, highlight=False, markup=False, width=width)


def to_jsonable(value: Any) -> Any:
    """Rows, dataclasses and enums as plain JSON: timestamps in ISO-8601 UTC, ids as strings."""
    if is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def workflow_known(session: Session, name: str) -> bool:
    """For a listing by workflow that found nothing: whether that workflow exists; if not, say
    so (a mistyped name otherwise reads as "no runs")."""
    if session.connect().execute(QUERIES["workflow_get"], {"workflow": name}).fetchone():
        return True
    message(f"no workflow named {name!r} is registered")
    return False


def note_hidden(shown: Shown) -> None:
    """Say which spare columns a narrow terminal left out, so none goes missing unnoticed."""
    if shown.hidden:
        hidden = ", ".join(shown.hidden)
        text = f"{PREFIX}not shown at {shown.width} columns: {hidden} (--json has all)"
        # Folded at word boundaries to the width the listing was laid out for.
        print(textwrap.fill(text, shown.width, subsequent_indent="  "), file=sys.stderr, flush=True)


# What json.dumps leaves raw with ensure_ascii=False though a terminal would obey it: DEL,
# the C1 controls (\x9b starts an escape sequence on some terminals), the Unicode line
# separators and the bidi overrides. Written as \uXXXX they are the same JSON.
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def emit_json(value: Any) -> None:
    text = json.dumps(to_jsonable(value), indent=2, ensure_ascii=False)
    text = _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()

"""Cyclone's configuration: one registry of settings drives loading, validation and the example.

`SETTINGS` is the single source of defaults, types, checks and docs: the section dataclasses,
`load_config` and `render_example` (config/cyclone.example.toml) all read it, so a key cannot be
documented in one place and forgotten in another; tests/unit/test_config.py checks they agree.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
import textwrap
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from cyclone.durations import (
    DURATION_HELP,
    DurationOutOfRange,
    format_duration,
    parse_duration,
)
from cyclone.errors import ConfigError
from cyclone.redact import URL_SCHEME, redact_dsn, show_value

MAX_CONFIG_BYTES = 1 << 20  # tomllib's docs warn that hostile TOML can eat CPU and memory
ENV_DATABASE_URL = "CYCLONE_DATABASE_URL"
ENV_CONSOLE_TOKEN = "CYCLONE_CONSOLE_TOKEN"
MIN_TOKEN_LENGTH = 16
EXAMPLE_DATABASE_URL = "postgresql://cyclone:PASSWORD@db.internal:5432/cyclone"

# --- the registry ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ValueType:
    """How a raw TOML value becomes a setting's value; `coerce` raises ValueError if it can't."""

    expected: str
    coerce: Callable[[Any], Any]
    render: Callable[[Any], str]


@dataclass(frozen=True, slots=True)
class Check:
    """A constraint on a coerced value; `expected` replaces the type's wording in messages."""

    expected: str
    test: Callable[[Any], bool]


def _exact(kind: type) -> Callable[[Any], Any]:
    def coerce(value: Any) -> Any:
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise ValueError(value)
        return value

    return coerce


def _coerce_modules(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(value)
    return tuple(value)


def _coerce_queues(value: Any) -> tuple[tuple[str, int | None], ...]:
    """[supervisor] queues: a list of names (served, no cap) or a table name = cap."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        pairs = [(name, None) for name in value]
    elif isinstance(value, dict) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value.values()
    ):
        pairs = list(value.items())
    else:
        raise ValueError(value)
    return tuple(sorted(pairs))


def _good_queues(pairs: tuple[tuple[str, int | None], ...]) -> bool:
    return (
        bool(pairs)
        and all(
            name and name == name.strip() and len(name) <= 100 and (cap is None or cap >= 1)
            for name, cap in pairs
        )
        and len({name for name, _ in pairs}) == len(pairs)
    )


def _is_dsn(url: str) -> bool:
    if URL_SCHEME.match(url):  # any other scheme (mysql://, postgresql+psycopg://) is a mistake
        return url.startswith(("postgresql://", "postgres://"))
    return "=" in url


def _ints(low: int, high: int | None = None) -> Check:
    if high is None:
        return Check(f"an integer >= {low}", lambda v: v >= low)
    return Check(f"an integer from {low} to {high}", lambda v: low <= v <= high)


def _one_of(*choices: str) -> Check:
    return Check("one of " + ", ".join(f'"{c}"' for c in choices), lambda v: v in choices)


# Sizes as systemd writes them (K, M, G, T are powers of 1024; KiB... too), or bytes.
_SIZE = re.compile(r"([0-9]+)\s*(|B|K|KiB|M|MiB|G|GiB|T|TiB)")
_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SIZE_HELP = 'a size in bytes, or like "512M" or "2GiB" (K, M, G, T: powers of 1024)'
MIN_MEMORY = 64 << 20  # below this a forked worker cannot even hold what it inherited
MAX_SIZE = 1 << 60  # within the kernel's rlim_t; far beyond any VM


def _coerce_size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(value)
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).removesuffix("iB")]


def _format_size(size: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return str(size)


STR = ValueType("a string", _exact(str), lambda v: json.dumps(v))
BOOL = ValueType("true or false", _exact(bool), lambda v: "true" if v else "false")
INT = ValueType("an integer", _exact(int), str)
DURATION = ValueType(
    f"a duration ({DURATION_HELP})", parse_duration, lambda v: json.dumps(format_duration(v))
)
MODULES = ValueType("a list of module names", _coerce_modules, lambda v: json.dumps(list(v)))
QUEUES = ValueType(
    "a list of queue names, or a table of queue = most workers, like { default = 4, emails = 2 }",
    _coerce_queues,
    lambda v: json.dumps(
        {name: cap for name, cap in v} if any(c for _, c in v) else [name for name, _ in v]
    ),
)
QUEUE_NAMES = Check(
    "queue names of 1 to 100 characters (each once), with caps >= 1, like "
    "{ default = 4, emails = 2 }",
    _good_queues,
)
SIZE = ValueType(SIZE_HELP, _coerce_size, lambda v: json.dumps(_format_size(v)))
MEMORY = Check(
    'a size of at least 64M, in bytes or like "512M" or "2GiB" (K, M, G, T: powers of 1024)',
    lambda v: MIN_MEMORY <= v <= MAX_SIZE,
)
POSITIVE = Check(f"a duration > 0 ({DURATION_HELP})", lambda v: v > 0)
DSN = Check('a "postgresql://" URL or a "key=value" connection string', _is_dsn)
TOKEN = Check(
    f"a string of at least {MIN_TOKEN_LENGTH} characters, no spaces or control characters",
    lambda v: len(v) >= MIN_TOKEN_LENGTH and v.isprintable() and not any(c.isspace() for c in v),
)
TRACE_URL = Check(
    'an http(s) URL with {trace_id} in it, like "https://jaeger.internal/trace/{trace_id}"',
    lambda v: v.startswith(("https://", "http://")) and "{trace_id}" in v
    and v.count("{") == 1 and v.count("}") == 1 and v.isprintable(),
)
MODULE_NAMES = Check(
    'a list of importable dotted module names, like ["myapp.workflows"]',
    # Syntax only: importing is the supervisor's job, after it has set up logging.
    lambda v: all(part.isidentifier() for name in v for part in name.split(".")),
)


@dataclass(frozen=True, slots=True)
class Setting:
    """One configuration key: where it lives, what it accepts, its default and what it is for."""

    section: str
    key: str
    type: ValueType
    default: Any
    validator: Check | None
    doc: str

    @property
    def label(self) -> str:
        return f"[{self.section}] {self.key}"

    @property
    def expected(self) -> str:
        return self.validator.expected if self.validator else self.type.expected


SECTION_DOCS = {
    "database": "Where runs live. Every supervisor, CLI and client sharing it sees the same runs.",
    "supervisor": "The per-VM process that forks workers and the scanner, and kills stuck ones.",
    "worker": "Leasing: a worker owns a step while its supervisor keeps renewing the step's lease.",
    "scanner": "Fails overdue runs, reclaims expired leases, wakes sleeps, deletes old runs.",
    "metrics": "Prometheus metrics, aggregated across the supervisor's processes, at /metrics.",
    "workflows": "Python modules that define workflows; imported by the supervisor at start-up.",
    "logging": "Log output of every Cyclone process.",
    "tracing": "OpenTelemetry: a span per attempt, in the trace current at submit.",
    "console": "The web console (`cyclone console`, the `cyclone[console]` extra): runs, the DLQ, "
    "limits, schedules and the fleet in a browser (docs/console.md).",
}

SETTINGS: tuple[Setting, ...] = (
    Setting("database", "url", STR, None, DSN,
            "PostgreSQL URL. Leave unset to start the embedded PostgreSQL (one-VM demos only). "
            f"{ENV_DATABASE_URL} overrides it; prefer that to keep the password out of this file."),
    Setting("database", "read_url", STR, None, DSN,
            "PostgreSQL URL of a read replica (a streaming standby) for what only reads: "
            "`cyclone runs/run/steps/dlq list/status/workers/workflows`, and the metrics' "
            "database gauges. Unset: the primary (url). Reads there may lag the primary; "
            "`cyclone status` shows by how much."),
    Setting("database", "listen_url", STR, None, DSN,
            "A URL straight to PostgreSQL for LISTEN alone, when url goes through a "
            "transaction-mode pooler (which cannot deliver notifications): cancels, ready "
            "steps and timers then wake at once instead of at the next poll. Unset: url."),
    Setting("database", "migrate", BOOL, True, None,
            "Apply pending schema migrations at start-up (under an advisory lock)."),
    Setting("database", "embedded_dir", STR, None, None,
            "Where the embedded PostgreSQL keeps its data when url is unset; a relative path is "
            "taken from this file's directory. Unset: $XDG_DATA_HOME/cyclone/pgdata (else "
            "~/.local/share/cyclone/pgdata). CYCLONE_EMBEDDED_DIR overrides it."),
    Setting("database", "prepared_statements", BOOL, True, None,
            "Let psycopg prepare a statement on the server after its fifth execution. Set false "
            "behind a transaction-mode pooler such as PgBouncer, where the next transaction may "
            "land on a server connection that does not have it (every statement is then planned "
            "each time)."),
    Setting("supervisor", "workers", INT, 4, _ints(1),
            "Worker processes to fork; each runs one step at a time."),
    Setting("supervisor", "kill_grace", DURATION, 2.0, None,
            "How long a worker gets to stop cooperatively before SIGKILL (a timeout, cancel, "
            "deadline or shutdown; a worker whose lease may lapse gets none)."),
    Setting("supervisor", "shutdown_timeout", DURATION, 30.0, None,
            "On SIGTERM, how long running steps may finish before they are killed and released."),
    Setting("supervisor", "max_steps_per_worker", INT, 10000, _ints(0),
            "Replace a worker after this many steps, to bound leaks; 0 never recycles."),
    Setting("supervisor", "dispatch", BOOL, True, None,
            "Lease for the idle workers and record the tasks they finished in one statement "
            "for all of them; false: each worker leases and records on its own session. Off "
            "when [database] prepared_statements is false."),
    Setting("supervisor", "wake", BOOL, True, None,
            "Wake an idle worker the moment a step becomes ready, and the scanner when a timer "
            "(a retry, a sleep, a max_wait, a deadline) comes due (LISTEN/NOTIFY; a "
            "transaction pooler cannot deliver them: polling then). False: idle workers look "
            "every poll_interval and timers wait for the scanner's interval."),
    Setting("supervisor", "queues", QUEUES, None, QUEUE_NAMES,
            "The queues this VM serves (a workflow's queue: Workflow(..., queue=...)). A list "
            "serves those queues; a table also caps how many of its workers each may hold at "
            "once, like { default = 4, emails = 2 } (a cap needs dispatch). Unset: every queue, "
            "no cap. Runs of a queue no live VM serves are reported, like unserved workflows."),
    Setting("worker", "lease_ttl", DURATION, 30.0, POSITIVE,
            "A lease not renewed for this long expires, and the scanner reclaims its step."),
    Setting("worker", "heartbeat_interval", DURATION, 5.0, POSITIVE,
            "How often the supervisor renews its busy workers' leases; at most a third of "
            "lease_ttl. A worker whose lease is not renewed is killed this long before the "
            "lease lapses."),
    Setting("worker", "poll_interval", DURATION, 1.0, POSITIVE,
            "How often an idle worker looks for work when nothing wakes it (see [supervisor] "
            "wake): a fallback, so a minute is as good as a second while notifications work."),
    Setting("worker", "max_memory", SIZE, None, MEMORY,
            "Most memory each worker process may allocate (its RLIMIT_DATA: heap and private "
            "mappings, what it inherited from the supervisor included); a handler past it gets "
            "MemoryError. Each process a handler starts gets the same limit of its own. Unset: "
            "no limit. Bound the whole service with systemd's MemoryMax."),
    Setting("scanner", "enabled", BOOL, True, None,
            "Run a scanner beside the workers. Any number of scanners are safe together."),
    Setting("scanner", "interval", DURATION, 1.0, POSITIVE, "Pause between scans."),
    Setting("scanner", "batch_size", INT, 500, _ints(1, 100000),
            "Most rows one sweep changes per transaction."),
    Setting("scanner", "retention", DURATION, 7 * 86400.0, None,
            "Finished runs older than this are deleted; 0 keeps them. A runtime role that "
            "does not own the schema keeps at least the last day's (migration 15)."),
    Setting("scanner", "archive_dir", STR, None, None,
            "Before retention drops a partition of history, write it to this directory as JSON "
            "lines (cyclone-history-<start>.jsonl: a line per run, its steps and attempts "
            "nested). Unset: dropped unarchived. A partition whose archive fails is kept."),
    Setting("scanner", "archive_command", STR, None, None,
            "Instead of archive_dir: a shell command that reads the JSON lines on its standard "
            "input (CYCLONE_ARCHIVE_FROM and CYCLONE_ARCHIVE_TO give the partition's range) and "
            "exits 0, e.g. \"gzip > /backup/cyclone-$CYCLONE_ARCHIVE_FROM.jsonl.gz\"."),
    Setting("scanner", "history_after", DURATION, 30.0, None,
            "Finished runs move out of the hot tables into history, partitioned by time, this "
            "long after they end; retention then drops history a partition at a time. 0 keeps "
            "them in the hot tables until retention deletes them (docs/scaling.md)."),
    Setting("metrics", "enabled", BOOL, True, None, "Serve Prometheus metrics."),
    Setting("metrics", "bind", STR, "127.0.0.1", None,
            "Address to listen on; metrics are not authenticated, so keep it private."),
    Setting("metrics", "port", INT, 9464, _ints(0, 65535), "Port to listen on; 0 picks one."),
    Setting("workflows", "modules", MODULES, (), MODULE_NAMES,
            "Dotted module names to import, e.g. [\"myapp.workflows\"], before the database is "
            "touched. Found on PYTHONPATH, in the installed packages, then in this file's "
            "directory."),
    Setting("logging", "level", STR, "info", _one_of("debug", "info", "warning", "error"),
            "Lowest level logged."),
    Setting("logging", "format", STR, "text", _one_of("text", "json"),
            "\"text\" for people, \"json\" (one object a line) for log shippers."),
    Setting("tracing", "enabled", BOOL, False, None,
            "Export a span per attempt with OpenTelemetry (needs the otel extra), child of the "
            "trace current at submit; the OTEL_* variables configure the exporter."),
    Setting("console", "bind", STR, "127.0.0.1", None,
            "Address the console listens on. Loopback by default: put it behind the operator's "
            "proxy (TLS, login) to reach it from elsewhere."),
    Setting("console", "port", INT, 8465, _ints(0, 65535), "Port to listen on; 0 picks one."),
    Setting("console", "token", STR, None, TOKEN,
            "Enables the console's actions (DLQ retry, cancel): an operator signs in with it. "
            f"Unset: the console is read-only. {ENV_CONSOLE_TOKEN} overrides it; prefer that "
            "to keep it out of this file."),
    Setting("console", "trace_url", STR, None, TRACE_URL,
            "A link to a run's trace in your tracing UI, with {trace_id} where the trace id "
            "goes, like \"https://jaeger.internal/trace/{trace_id}\" (runs that carry a trace)."),
)  # fmt: skip

_BY_SECTION: dict[str, dict[str, Setting]] = {}
for _s in SETTINGS:
    _BY_SECTION.setdefault(_s.section, {})[_s.key] = _s


def _default(section: str, key: str) -> Any:
    return _BY_SECTION[section][key].default


# --- the settings -------------------------------------------------------------------------
# Written out (not generated) so type checkers and editors see the fields; defaults come from
# the registry, and a test checks both list the same keys.


@dataclass(frozen=True, slots=True)
class DatabaseConfig:
    url: str | None = _default("database", "url")
    read_url: str | None = _default("database", "read_url")
    listen_url: str | None = _default("database", "listen_url")
    migrate: bool = _default("database", "migrate")
    embedded_dir: str | None = _default("database", "embedded_dir")
    prepared_statements: bool = _default("database", "prepared_statements")

    def __repr__(self) -> str:  # settings get logged; the password must not be
        url = None if self.url is None else redact_dsn(self.url)
        read_url = None if self.read_url is None else redact_dsn(self.read_url)
        listen = None if self.listen_url is None else redact_dsn(self.listen_url)
        return (
            f"DatabaseConfig(url={url!r}, read_url={read_url!r}, listen_url={listen!r}, "
            f"migrate={self.migrate!r}, "
            f"embedded_dir={self.embedded_dir!r}, "
            f"prepared_statements={self.prepared_statements!r})"
        )


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    workers: int = _default("supervisor", "workers")
    kill_grace: float = _default("supervisor", "kill_grace")
    shutdown_timeout: float = _default("supervisor", "shutdown_timeout")
    max_steps_per_worker: int = _default("supervisor", "max_steps_per_worker")
    dispatch: bool = _default("supervisor", "dispatch")
    wake: bool = _default("supervisor", "wake")
    queues: tuple[tuple[str, int | None], ...] | None = _default("supervisor", "queues")

    def serves(self, queue: str) -> bool:
        return self.queues is None or any(name == queue for name, _ in self.queues)

    def caps(self) -> dict[str, int]:
        """The queues with a cap on the workers they may hold, and their caps."""
        return {name: cap for name, cap in self.queues or () if cap is not None}


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    lease_ttl: float = _default("worker", "lease_ttl")
    heartbeat_interval: float = _default("worker", "heartbeat_interval")
    poll_interval: float = _default("worker", "poll_interval")
    max_memory: int | None = _default("worker", "max_memory")


@dataclass(frozen=True, slots=True)
class ScannerConfig:
    enabled: bool = _default("scanner", "enabled")
    interval: float = _default("scanner", "interval")
    batch_size: int = _default("scanner", "batch_size")
    retention: float = _default("scanner", "retention")
    archive_dir: str | None = _default("scanner", "archive_dir")
    archive_command: str | None = _default("scanner", "archive_command")
    history_after: float = _default("scanner", "history_after")


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    enabled: bool = _default("metrics", "enabled")
    bind: str = _default("metrics", "bind")
    port: int = _default("metrics", "port")


@dataclass(frozen=True, slots=True)
class WorkflowsConfig:
    modules: tuple[str, ...] = _default("workflows", "modules")


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: str = _default("logging", "level")
    format: str = _default("logging", "format")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    enabled: bool = _default("tracing", "enabled")


@dataclass(frozen=True, slots=True)
class ConsoleConfig:
    bind: str = _default("console", "bind")
    port: int = _default("console", "port")
    token: str | None = _default("console", "token")
    trace_url: str | None = _default("console", "trace_url")

    def __repr__(self) -> str:  # settings get logged; the token must not be
        token = None if self.token is None else "<set>"
        return (
            f"ConsoleConfig(bind={self.bind!r}, port={self.port!r}, token={token!r}, "
            f"trace_url={self.trace_url!r})"
        )


@dataclass(frozen=True, slots=True)
class Settings:
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    scanner: ScannerConfig = field(default_factory=ScannerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    workflows: WorkflowsConfig = field(default_factory=WorkflowsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)


SECTION_CLASSES: dict[str, type] = {f.name: f.default_factory for f in fields(Settings)}  # type: ignore[misc]


# --- loading ----------------------------------------------------------------------------------


def _fail(origin: str, message: str) -> ConfigError:
    # One line, always: operators grep logs and systemd shows only the last line.
    return ConfigError(" ".join(f"{origin}: {message}".splitlines()))


def _did_you_mean(word: str, choices: list[str], fmt: str = '"{}"') -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {fmt.format(close[0])}?)" if close else ""


def _read_toml(origin: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as fp:
            data = fp.read(MAX_CONFIG_BYTES + 1)  # read no more than the cap, even from a pipe
    except OSError as exc:
        raise _fail(origin, f"cannot read the config file: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise _fail(origin, "the config file is larger than 1 MiB; refusing to parse it")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _fail(origin, f"not UTF-8 text (bad byte at offset {exc.start})") from None
    except RecursionError:
        raise _fail(origin, "invalid TOML: values nested too deeply") from None
    except tomllib.TOMLDecodeError as exc:
        text = str(exc)
        where = re.search(r"\s*\((at line \d+, column \d+|at end of document)\)$", text)
        if where:
            text = f"{where.group(1).removeprefix('at ')}: {text[: where.start()]}"
        raise _fail(origin, f"invalid TOML: {text}") from None


def _check_value(origin: str, setting: Setting, raw: Any) -> Any:
    why = ""
    try:
        value = setting.type.coerce(raw)
        valid = setting.validator is None or setting.validator.test(value)
    except DurationOutOfRange as exc:
        valid, why = False, f": a duration {exc.why}"
    except (ValueError, TypeError):
        valid = False
    if not valid:
        # A secret is never echoed, even a bad one: say only what it looked like.
        shown = show_value(raw)
        if setting.validator is TOKEN:
            shown = f"a {type(raw).__name__} of {len(raw)} characters" if isinstance(
                raw, str) else type(raw).__name__
        raise _fail(origin, f"{setting.label}: expected {setting.expected}, got {shown}{why}")
    return value


def _check_document(origin: str, doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    values: dict[str, dict[str, Any]] = {section: {} for section in _BY_SECTION}
    for section, table in doc.items():
        known = _BY_SECTION.get(section)
        if known is None:
            is_table = isinstance(table, dict)
            homes = [s.label for s in SETTINGS if s.key == section and not is_table]
            hint = f" (did you mean {homes[0]}?)" if homes else ""
            hint = hint or _did_you_mean(section, list(_BY_SECTION), "[{}]")
            what = "section" if is_table else "top-level key"
            raise _fail(origin, f'unknown {what} "{section}"{hint}')
        if not isinstance(table, dict):
            raise _fail(origin, f"{section}: expected a table [{section}], got {show_value(table)}")
        for key, raw in table.items():
            setting = known.get(key)
            if setting is None:
                hint = _did_you_mean(key, list(known))
                homes = [s.section for s in SETTINGS if s.key == key]
                if not hint and homes:
                    hint = f" (it belongs in [{homes[0]}])"
                raise _fail(origin, f'[{section}] unknown key "{key}"{hint}')
            values[section][key] = _check_value(origin, setting, raw)
    return values


def _check_together(origin: str, settings: Settings) -> None:
    # Per-queue caps are kept by the supervisor as it leases for its workers (dispatch);
    # workers leasing on their own could not keep them.
    if settings.supervisor.caps() and not (
        settings.supervisor.dispatch and settings.database.prepared_statements
    ):
        raise _fail(
            origin,
            "[supervisor] queues: per-queue caps need [supervisor] dispatch = true (and "
            "[database] prepared_statements = true); list the queues without caps instead",
        )
    # A worker whose lease was not renewed is killed heartbeat_interval before the lease can
    # lapse (cyclone.child.lease.lease_trust), so the lease is acted on for
    # lease_ttl - heartbeat_interval. One missed heartbeat must not cost a healthy step that:
    # two heartbeat intervals must fit in it.
    beat, ttl = settings.worker.heartbeat_interval, settings.worker.lease_ttl
    if not beat * 3 <= ttl:
        limit = f"at most a third of [worker] lease_ttl ({format_duration(round(ttl / 3, 3))})"
        raise _fail(
            origin, f"[worker] heartbeat_interval: expected {limit}, got {format_duration(beat)}"
        )


def load_config(
    path: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None
) -> Settings:
    """Read, validate and return the settings; every problem is a one-line ConfigError.

    `path=None` means the defaults. `CYCLONE_DATABASE_URL` in `env` (default `os.environ`)
    overrides `[database] url`; an empty value counts as unset.
    """
    env = os.environ if env is None else env
    origin = "<defaults>" if path is None else os.fsdecode(path)
    doc = {} if path is None else _read_toml(origin, path)
    values = _check_document(origin, doc)
    env_url = env.get(ENV_DATABASE_URL)
    if env_url:
        values["database"]["url"] = _check_value(
            ENV_DATABASE_URL, _BY_SECTION["database"]["url"], env_url
        )
    env_token = env.get(ENV_CONSOLE_TOKEN)
    if env_token:
        values["console"]["token"] = _check_value(
            ENV_CONSOLE_TOKEN, _BY_SECTION["console"]["token"], env_token
        )
    url = values["database"].get("url")
    if url is not None:
        from cyclone.db import check_dsn

        try:
            # Syntax is left to the connection: the config keeps accepting what it accepted.
            check_dsn(url, syntax=False)
        except ConfigError as exc:
            if env_url:
                raise _fail(ENV_DATABASE_URL, str(exc)) from None
            raise _fail(origin, f"[database] url: {exc}") from None
    embedded_dir = values["database"].get("embedded_dir")
    if embedded_dir is not None and path is not None:
        # Relative to the file, not to wherever the command happens to run.
        here = os.path.dirname(os.path.abspath(path))
        values["database"]["embedded_dir"] = os.path.join(here, os.path.expanduser(embedded_dir))
    settings = Settings(**{name: cls(**values[name]) for name, cls in SECTION_CLASSES.items()})
    _check_together(origin, settings)
    return settings


def settings_as_dict(settings: Settings) -> dict[str, dict[str, Any]]:
    """The settings as plain JSON-ready data, by section, with the database password redacted."""
    out = asdict(settings)
    for key in ("url", "read_url"):
        if out["database"][key] is not None:
            out["database"][key] = redact_dsn(out["database"][key])
    out["workflows"]["modules"] = list(out["workflows"]["modules"])
    if out["console"]["token"] is not None:
        out["console"]["token"] = "<set>"
    return out


# --- the example ----------------------------------------------------------------------------

_EXAMPLE_HEADER = f"""\
# Cyclone configuration for a VM. Every key is optional; the values shown are the defaults.
# Generated by `python -m cyclone.config --example` from cyclone/config.py; regenerate it
# rather than editing this copy by hand.
# Durations: {DURATION_HELP}.
"""


# What the example shows, commented out, for the settings that are unset by default.
_EXAMPLES = {
    "url": EXAMPLE_DATABASE_URL,
    "read_url": "postgresql://cyclone_readonly:PASSWORD@db-replica.internal:5432/cyclone",
    "listen_url": "postgresql://cyclone@db-primary.internal:5432/cyclone",
    "embedded_dir": "/var/lib/cyclone/pgdata",
    "max_memory": "2G",
    "archive_dir": "/var/lib/cyclone/archive",
    "archive_command": "gzip > /backup/cyclone-$CYCLONE_ARCHIVE_FROM.jsonl.gz",
    "token": "a-long-random-string",
    "trace_url": "https://jaeger.internal/trace/{trace_id}",
}


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, width=98, initial_indent="# ", subsequent_indent="# ")


def render_example() -> str:
    """The commented example TOML, generated from `SETTINGS` (config/cyclone.example.toml)."""
    lines = _EXAMPLE_HEADER.splitlines()
    for section, doc in SECTION_DOCS.items():
        lines += ["", *_comment(doc), f"[{section}]"]
        for i, setting in enumerate(_BY_SECTION[section].values()):
            lines += [""] if i else []
            lines += _comment(setting.doc)
            if setting.key == "queues":
                lines.append("# queues = { default = 4, emails = 2 }")
            elif setting.default is None:
                lines.append(f'# {setting.key} = "{_EXAMPLES[setting.key]}"')
            else:
                lines.append(f"{setting.key} = {setting.type.render(setting.default)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--example"]:
        sys.exit("usage: python -m cyclone.config --example")
    sys.stdout.write(render_example())

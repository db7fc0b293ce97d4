"""The database password reaches no message, log line or handler environment (issue 22, item 8):
a URL libpq cannot read, or reads differently than its author meant, fails in one line
without it, in the supervisor, the CLI and `Client.__init__`."""

from __future__ import annotations

import io
import logging
import os
import urllib.parse

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import cyclone
from cyclone.child.environ import scrub_environment
from cyclone.cli import main as cli_main
from cyclone.config import load_config
from cyclone.db import check_dsn
from cyclone.errors import ConfigError
from cyclone.redact import redact_error
from cyclone.sanitize import SafeRecords
from cyclone.supervisor.__main__ import JsonFormatter, setup_logging
from cyclone.supervisor.__main__ import main as supervisor_main

# Markers on both ends: a leak of either end of the password shows whatever its middle is.
passwords = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=24).map(
    lambda middle: f"Sekr1t{middle}Tk3s"
)


def assert_hidden(password: str, text: str) -> None:
    assert "Sekr1t" not in text and "Tk3s" not in text, (password, text)


def raw_urls(password: str) -> list[str]:
    """URLs as an operator pastes them: the password unescaped ("%", "@", "/" and all)."""
    return [
        f"postgresql://cyclone:{password}@db.internal:5432/cyclone",
        f"postgresql://cyclone:{password}@db.internal/cyclone?sslmode=require",
        f"host=db.internal password={password} dbname=cyclone",
    ]


MISREAD = [
    "postgresql://cyclone:Sekr1t%zzTk3s@127.0.0.1:1/db",  # a bad % escape (the issue's)
    "postgresql://cyclone:Sekr1t@Tk3s@127.0.0.1:1/db",  # "@": the rest becomes the host
    "postgresql://cyclone:Sekr1t/Tk3s@127.0.0.1:1/db",  # "/": a port and a database name
    "host=127.0.0.1 password=Sekr1t Tk3s dbname=db",  # a space, unquoted
]


@pytest.mark.parametrize("dsn", MISREAD)
def test_check_dsn_refuses_a_misread_url_without_quoting_it(dsn: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_dsn(dsn)
    assert_hidden(dsn, str(info.value))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dsn", MISREAD)
def test_a_client_refuses_a_misread_url_at_once_and_logs_nothing(dsn, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    for make in (cyclone.Client, cyclone.AsyncClient):
        with pytest.raises(ConfigError) as info:
            make(dsn)
        assert_hidden(dsn, str(info.value))
    assert caplog.records == []


@pytest.mark.parametrize("dsn", MISREAD)
def test_the_supervisor_refuses_a_misread_url_in_one_line_with_exit_2(
    dsn, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("CYCLONE_DATABASE_URL", dsn)
    assert supervisor_main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("cyclone-supervisor: CYCLONE_DATABASE_URL: [database] url:")
    assert_hidden(dsn, captured.err)


@pytest.mark.parametrize("dsn", MISREAD)
def test_the_cli_refuses_a_misread_url_in_one_line_with_exit_2(dsn, capsys) -> None:
    assert cli_main(["--dsn", dsn, "runs"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert_hidden(dsn, err)


@hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(password=passwords)
def test_no_password_leaks_from_the_checks_whatever_it_holds(password: str) -> None:
    for dsn in raw_urls(password):
        try:
            check_dsn(dsn)
        except ConfigError as exc:
            assert_hidden(password, str(exc))
        # What libpq and the server say about a DSN they misread quotes its pieces back.
        cut = len(password) // 2
        for piece in (password, password[:cut], password[cut:] + "@db.internal"):
            text = f'could not translate host name "{piece}" to address: port "{piece}"'
            assert_hidden(password, redact_error(text, dsn))


def test_an_error_keeps_what_is_not_the_password() -> None:
    dsn = "postgresql://cyclone:hunter2@db.internal/cyclone"
    text = 'could not translate host name "db.internal" to address: user "cyclone"'
    assert redact_error(text, dsn) == text


def log_line(formatter: logging.Formatter, dsn: str, *args: object, exc: bool = False) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(SafeRecords(dsn))
    logger = logging.getLogger("test_secrets.safe")
    logger.propagate = False
    logger.handlers[:] = [handler]
    try:
        if exc:
            try:
                raise RuntimeError(f"cannot connect to {dsn}")
            except RuntimeError:
                logger.exception("failed: %s", *args)
        else:
            logger.warning("failed: %s", *args)
    finally:
        logger.handlers[:] = []
    return stream.getvalue()


@pytest.mark.parametrize("formatter", [logging.Formatter("%(message)s"), JsonFormatter()])
def test_the_supervisors_log_lines_never_show_the_password(formatter) -> None:
    dsn = "postgresql://cyclone:Sekr1tTk3s@db.internal/cyclone"
    assert_hidden(dsn, log_line(formatter, dsn, f"url {dsn}"))
    assert_hidden(dsn, log_line(formatter, dsn, 'host "Sekr1tTk3s"', exc=True))
    kv = "host=db.internal password=Sekr1tTk3s"
    assert_hidden(kv, log_line(formatter, kv, kv, exc=True))


def test_the_supervisors_logging_removes_the_password_and_escapes_controls(capsys) -> None:
    dsn = "postgresql://cyclone:Sekr1tTk3s@db.internal/cyclone"
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging(load_config(None, env={"CYCLONE_DATABASE_URL": dsn}))
        logging.getLogger("cyclone.test").warning("host %s\nforged line\x1b[2J", '"Sekr1t"')
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    err = capsys.readouterr().err
    assert_hidden(dsn, err)
    assert err.count("\n") == 1 and "\x1b" not in err
    assert "\\nforged line\\x1b[2J" in err


def test_a_worker_drops_the_secret_bearing_variables(monkeypatch) -> None:
    dsn = "postgresql://cyclone:Sekr1tTk3s@db.internal/cyclone"
    monkeypatch.setenv("CYCLONE_DATABASE_URL", dsn)
    monkeypatch.setenv("PGPASSWORD", "other-Sekr1t")
    monkeypatch.setenv("APP_DATABASE_URL", dsn + "?sslmode=require")
    monkeypatch.setenv("APP_DB", "host=db password=Sekr1tTk3s")
    monkeypatch.setenv("APP_SECRET", "Sekr1tTk3s")
    monkeypatch.setenv("UNRELATED", "kept")
    # Holds the password, but is no connection string: a password "postgres" and
    # HOME=/var/lib/postgresql must not cost a handler its HOME.
    monkeypatch.setenv("DATA_DIR", "/var/lib/Sekr1tTk3s/data")
    assert scrub_environment(dsn) == dsn  # it has its password: PGPASSWORD is not moved in
    for name in ("CYCLONE_DATABASE_URL", "PGPASSWORD", "APP_DATABASE_URL", "APP_DB", "APP_SECRET"):
        assert name not in os.environ
    assert os.environ["UNRELATED"] == "kept"
    assert os.environ["DATA_DIR"] == "/var/lib/Sekr1tTk3s/data"


def test_a_dsn_relying_on_pgpassword_gets_it_before_it_is_dropped(monkeypatch) -> None:
    monkeypatch.setenv("PGPASSWORD", "Sekr1tTk3s")
    monkeypatch.setenv("ALSO", "postgresql://u:Sekr1tTk3s@elsewhere/db")
    dsn = scrub_environment("host=db.internal user=cyclone")
    assert "PGPASSWORD" not in os.environ and "ALSO" not in os.environ
    from psycopg.conninfo import conninfo_to_dict

    assert conninfo_to_dict(dsn)["password"] == "Sekr1tTk3s"


def test_an_escaped_password_is_accepted() -> None:
    password = "p%@/ss w:rd"
    check_dsn(f"postgresql://cyclone:{urllib.parse.quote(password, safe='')}@db.internal/db")


def test_the_clis_top_level_database_errors_have_their_exit_status(capsys) -> None:
    import psycopg

    from cyclone.cli import _database_error
    from cyclone.cli.common import REFUSED, UNREACHABLE, Session

    session = Session("postgresql://cyclone:Sekr1tTk3s@db.internal/cyclone", None)
    assert session.dsn  # resolved: messages are redacted against it
    lost = psycopg.OperationalError('server closed the connection: host "Sekr1tTk3s"')
    assert _database_error(session, lost) == UNREACHABLE
    busy = psycopg.errors.SerializationFailure("could not serialize access")
    assert _database_error(session, busy) == REFUSED
    err = capsys.readouterr().err
    assert err.count("\n") == 2
    assert_hidden("Sekr1tTk3s", err)


def test_the_refusal_reads_whole_even_for_a_password_libpq_cut_short(capsys) -> None:
    # libpq reads the password as "p" here: hiding every "p" would garble the hint itself.
    assert cli_main(["--dsn", "postgresql://cyclone:p@ss@127.0.0.1:1/db", "runs"]) == 2
    err = capsys.readouterr().err
    assert 'holds an "@" (in a URL, write "@" in the password as %40' in err
    assert "ss@127" not in err


def test_the_supervisors_top_level_database_errors_have_their_exit_status(capsys) -> None:
    import psycopg

    from cyclone.supervisor.__main__ import database_error

    url = "postgresql://cyclone:Sekr1tTk3s@db.internal/cyclone"
    cases = [
        (psycopg.OperationalError('connection to "Sekr1tTk3s" failed\nsecond'), 3),  # no SQLSTATE
        (psycopg.errors.AdminShutdown("terminating connection"), 3),  # 57P01: restarting
        (psycopg.errors.SerializationFailure("could not serialize"), 3),  # 40001: retry
        (psycopg.errors.QueryCanceled("statement timeout"), 3),
        (psycopg.errors.InsufficientPrivilege("permission denied"), 2),  # a restart won't help
        (psycopg.errors.ReadOnlySqlTransaction("read-only"), 2),
    ]
    for exc, code in cases:
        assert database_error(exc, url) == code, exc
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("cyclone-supervisor: database ")
        assert_hidden(url, err)

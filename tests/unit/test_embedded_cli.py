"""The embedded PostgreSQL as an operator meets it: one place whatever the current directory,
created only by commands that set the database up, stopped by `cyclone embedded stop`; and
database URLs that are not PostgreSQL's, or that libpq refuses, are configuration errors."""

from __future__ import annotations

import pytest

from cyclone import embedded
from cyclone.cli import main
from cyclone.config import load_config
from cyclone.errors import ConfigError
from cyclone.supervisor.__main__ import main as supervisor_main


def test_read_only_commands_never_create_a_cluster_and_say_what_to_do(operator, capsys):
    pgdata, elsewhere = operator
    for argv in (["runs"], ["status", "--once"], ["workers"], ["dlq", "list"]):
        assert main(argv) == 3, argv
        err = capsys.readouterr().err
        assert "`cyclone migrate` creates and starts one" in err and str(pgdata) in err
    assert not pgdata.exists()
    assert list(elsewhere.iterdir()) == []  # no .cyclone/pgdata beside wherever we ran


def test_the_data_directory_comes_from_the_config_file_not_the_current_directory(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("CYCLONE_EMBEDDED_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    conf = tmp_path / "etc" / "cyclone.toml"
    conf.parent.mkdir()
    conf.write_text('[database]\nembedded_dir = "pg"\n')
    for cwd in (tmp_path, conf.parent):
        monkeypatch.chdir(cwd)
        assert load_config(conf).database.embedded_dir == str(conf.parent / "pg")
        assert embedded.data_dir() == tmp_path / "xdg" / "cyclone" / "pgdata"
    monkeypatch.setenv("CYCLONE_EMBEDDED_DIR", str(tmp_path / "env"))
    assert embedded.data_dir(load_config(conf).database.embedded_dir) == tmp_path / "env"


@pytest.mark.parametrize(
    "dsn",
    ["sslmode=bogus", "postgresql://u:Sekr1t@db.internal/app?sslmode=bogus",
     "host=/tmp target_session_attrs=sometimes"],
)  # fmt: skip
def test_a_value_libpq_refuses_is_a_configuration_error(dsn, capsys, monkeypatch):
    assert main(["--dsn", dsn, "runs"]) == 2
    err = capsys.readouterr().err
    assert "not a value PostgreSQL accepts" in err and "Sekr1t" not in err
    monkeypatch.setenv("CYCLONE_DATABASE_URL", dsn)
    with pytest.raises(ConfigError, match=r"CYCLONE_DATABASE_URL: .*not a value PostgreSQL"):
        load_config(None)
    assert supervisor_main([]) == 2
    assert "not a value PostgreSQL accepts" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["mysql://app:Sekr1t@db/app", "sqlite:///tmp/x.db"])
def test_another_databases_url_is_named_as_such(url, capsys, monkeypatch):
    assert main(["--dsn", url, "runs"]) == 2
    err = capsys.readouterr().err
    assert "not a PostgreSQL URL" in err and "Sekr1t" not in err and 'missing "="' not in err
    monkeypatch.setenv("CYCLONE_DATABASE_URL", url)
    assert main(["runs"]) == 2
    assert "CYCLONE_DATABASE_URL: not a PostgreSQL URL" in capsys.readouterr().err


def test_an_embedded_directory_that_cannot_work_is_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("CYCLONE_DATABASE_URL", raising=False)
    spaced = tmp_path / "my data" / "pg"
    monkeypatch.setenv("CYCLONE_EMBEDDED_DIR", str(spaced))
    assert main(["migrate"]) == 2
    assert "(a path with a space)" in capsys.readouterr().err
    assert not spaced.exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "PG_VERSION").write_text("9\n")
    monkeypatch.setenv("CYCLONE_EMBEDDED_DIR", str(old))
    assert main(["migrate"]) == 2
    err = capsys.readouterr().err
    assert "is PostgreSQL 9, this install runs" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("dsn", "url"),
    [
        ("host=/tmp/cyclone-0/pg port=5432 user=postgres dbname=postgres",
         "postgresql://postgres@/postgres?host=%2Ftmp%2Fcyclone-0%2Fpg&port=5432"),
        ("host='/tmp/a b' user=me dbname=x", "postgresql://me@/x?host=%2Ftmp%2Fa%20b"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
    ],
)  # fmt: skip
def test_embedded_start_prints_a_url_as_it_says(dsn: str, url: str) -> None:
    """Issue 27, item 15: `embedded start` said it prints a URL and printed key=value."""
    from psycopg.conninfo import conninfo_to_dict

    assert embedded.as_url(dsn) == url
    assert conninfo_to_dict(url) == conninfo_to_dict(dsn)


def test_embedded_help_names_xdg_data_home(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    for argv in (["embedded", "--help"], ["embedded", "start", "--help"]):
        assert main(argv) == 0
        assert "$XDG_DATA_HOME/cyclone/pgdata" in capsys.readouterr().out

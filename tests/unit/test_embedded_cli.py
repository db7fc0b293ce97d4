"""The embedded PostgreSQL as an operator meets it: one place whatever the current directory,
created only by commands that set the database up, stopped by `cyclone embedded stop`; and
database URLs that are not PostgreSQL's, or that libpq refuses, are configuration errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cyclone import embedded
from cyclone.cli import main
from cyclone.config import load_config
from cyclone.errors import ConfigError
from cyclone.supervisor.__main__ import main as supervisor_main

SCRIPT = shutil.which("cyclone", path=str(Path(sys.executable).parent)) or "cyclone"


@pytest.fixture
def operator(monkeypatch, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """No database URL, a fresh embedded directory, and a current directory elsewhere."""
    data = Path(tempfile.mkdtemp(prefix="cyc-", dir="/tmp"))  # short: the socket lives in it
    data.chmod(0o755)
    pgdata = data / "pgdata"
    monkeypatch.delenv("CYCLONE_DATABASE_URL", raising=False)
    monkeypatch.setenv("CYCLONE_EMBEDDED_DIR", str(pgdata))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    yield pgdata, elsewhere
    embedded.stop_server(pgdata, timeout=10)
    shutil.rmtree(data, ignore_errors=True)


def test_read_only_commands_never_create_a_cluster_and_say_what_to_do(operator, capsys):
    pgdata, elsewhere = operator
    for argv in (["runs"], ["status", "--once"], ["workers"], ["dlq", "list"]):
        assert main(argv) == 3, argv
        err = capsys.readouterr().err
        assert "`cyclone migrate` creates and starts one" in err and str(pgdata) in err
    assert not pgdata.exists()
    assert list(elsewhere.iterdir()) == []  # no .cyclone/pgdata beside wherever we ran


def test_one_cluster_whatever_the_directory_announced_stopped_and_never_restarted(
    operator, capsys, monkeypatch
):
    pgdata, elsewhere = operator
    assert main(["migrate"]) == 0
    err = capsys.readouterr().err
    assert err.count("created an embedded PostgreSQL") == 1 and str(pgdata) in err
    assert "cyclone embedded stop" in err
    pid = embedded.inspect(pgdata).pid
    assert pid is not None

    other = elsewhere.parent / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    assert main(["runs", "--json"]) == 0  # the same cluster, migrated above
    assert json.loads(capsys.readouterr().out) == []
    assert main(["embedded", "status", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["state"], info["pid"], info["data_dir"]) == ("running", pid, str(pgdata))
    assert info["this_install"] is True and info["problem"] is None

    assert main(["embedded", "stop"]) == 0
    assert f"stopped the embedded PostgreSQL in {pgdata} (pid {pid})" in capsys.readouterr().err
    assert not embedded._alive(pid)
    assert main(["status", "--once"]) == 3
    err = capsys.readouterr().err
    assert "is not running: start it with `cyclone embedded start`" in err
    assert embedded.inspect(pgdata).pid is None  # status did not start it again
    assert main(["embedded", "status"]) == 1
    assert "stopped" in capsys.readouterr().out
    assert main(["embedded", "stop"]) == 0
    assert "nothing to stop" in capsys.readouterr().err


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


def test_no_command_prints_a_runtime_dir_warning(tmp_path):
    environ = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    environ.pop("CYCLONE_DATABASE_URL", None)
    environ["CYCLONE_EMBEDDED_DIR"] = str(tmp_path / "none")
    for argv, code in ((["embedded", "status"], 1), (["runs"], 3)):
        out = subprocess.run(
            [SCRIPT, *argv], capture_output=True, text=True, env=environ, timeout=60
        )
        assert out.returncode == code, out.stderr
        assert "Warning" not in out.stderr, out.stderr


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

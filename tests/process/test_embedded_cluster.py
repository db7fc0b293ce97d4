"""The embedded PostgreSQL as an operator meets it, with real processes: one cluster whatever
the current directory, announced when created, stopped by `cyclone embedded stop` and never
started again by a status; the console script says nothing of a missing XDG_RUNTIME_DIR."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from cyclone import embedded
from cyclone.cli import main

SCRIPT = shutil.which("cyclone", path=str(Path(sys.executable).parent)) or "cyclone"


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

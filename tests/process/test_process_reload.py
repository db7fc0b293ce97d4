"""SIGHUP says what a reload can and cannot change, and names runs no worker serves (issue 11,
item 9)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from proc_helpers import completed, render_config, wait_for

pytestmark = pytest.mark.process


def test_a_reload_warns_about_runs_no_worker_serves_until_their_module_is_loaded(
    env, supervisor
) -> None:
    from proc_trust_flows import fanout

    sup = supervisor(workers=1)  # [workflows] modules = ["proc_flows"] only
    run_id = env.client.submit(fanout, {"n": 2})
    os.kill(sup.pid, signal.SIGHUP)
    wait_for(lambda: "no worker serves wait" in sup.log(), 10, f"the warning\n{sup.log()}")
    log = sup.log()
    assert "reload cannot change" in log and "code of modules already imported" in log
    version = fanout.graph.hash
    assert f"trust-fanout version {version[:12]} (1 runs)" in log
    wait_for(
        lambda: sup.sample("cyclone_runs_unserved", workflow="trust-fanout", graph=version) == 1,
        10, "the unserved gauge",
    )  # fmt: skip
    status = subprocess.run(
        [sys.executable, "-m", "cyclone.cli", "--dsn", env.dsn, "status", "--json"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert json.loads(status.stdout)["unserved"] == [
        {"workflow": "trust-fanout", "graph_hash": version, "runs": 1}
    ]
    # Listing the module and reloading serves it: the run completes, the warning goes.
    settings = {
        "supervisor.workers": "1",
        "supervisor.shutdown_timeout": '"5s"',
        "workflows.modules": '["proc_flows", "proc_trust_flows"]',
    }
    sup.config.write_text(render_config(settings))
    os.kill(sup.pid, signal.SIGHUP)
    wait_for(lambda: completed(env, run_id), 15, f"the run to complete\n{sup.log()}")
    assert "workers will serve: proc-busy" in sup.log()

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cyclone import RunState, demo
from cyclone.testing import TestEnv


def test_demo_order_and_flaky_workflows_complete(env: TestEnv):
    order = env.client.submit(demo.orders, {"order": 1, "items": ["a", "b"]})
    env.client.signal(order, "approved", {"by": "test"})
    flaky = env.client.submit(demo.flaky, {})
    assert env.run_until_complete(order).output == {"ship": {"label": {"label": "PKG-1"}}}
    st = env.run_until_complete(flaky)
    assert (st.state, st.output) == (RunState.COMPLETED, {"call_partner": "answered on attempt 3"})


@pytest.mark.process
def test_the_demo_says_what_to_do_next_and_stops_on_ctrl_c(env: TestEnv, tmp_path: Path):
    """`python -m cyclone.demo`, run from another directory on a config of the test's own."""
    config = Path(demo.__file__).parents[1] / "config" / "demo.toml"
    text = config.read_text().replace("port = 9464", "port = 0")
    (tmp_path / "demo.toml").write_text(text)
    log = tmp_path / "demo.log"
    environ = {**os.environ, "CYCLONE_DATABASE_URL": env.dsn}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cyclone.demo", "demo.toml"], cwd=tmp_path, env=environ,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "the demo runs have ended" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        said = log.read_text()
        assert "the demo runs have ended (4 completed, 1 failed)" in said
        # Issue 27, item 16: what `cyclone runs` then lists, child runs included, is said.
        assert "submitted 5 demo runs (the orders start 3 child runs more: cyclone runs " \
            "lists 8)" in said
        listed = env.conn.execute("SELECT count(*) AS n FROM cyclone_v_runs").fetchone()["n"]
        assert listed == 8
        assert said.count("cyclone status") == 2 and said.count("Ctrl-C") == 2
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert proc.wait(30) == 0, log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert "draining" in log.read_text()

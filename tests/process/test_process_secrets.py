"""The database password stays out of what handlers pass on, and a database error at the
supervisor's top is one line without it and a deliberate exit status (issue 22, item 8)."""

from __future__ import annotations

import json
import subprocess
import sys

from proc_helpers import HERE, render_config, terminal, wait_for
from psycopg.conninfo import make_conninfo

from cyclone.db import with_options
from cyclone.states import RunState

SECRET = "Sekr1tTk3s"


def test_handlers_and_what_they_start_see_no_secret_bearing_variable(env, supervisor) -> None:
    from proc_secret_flows import peek

    # Trust authentication ignores the password; the supervisor is given it all the same.
    dsn = make_conninfo(env.dsn, password=SECRET)
    supervisor(
        workflows__modules='["proc_secret_flows"]', dsn=dsn,
        environ={"PGPASSWORD": SECRET, "APP_DATABASE_URL": f"{dsn} sslmode=disable",
                 "UNRELATED_SETTING": "kept"},
    )  # fmt: skip
    run_id = env.client.submit(peek, {})
    status = wait_for(lambda: terminal(env, run_id), 15, "the run")
    assert status.state == RunState.COMPLETED, status.error
    seen = status.output["environment"]
    for where in ("handler", "child"):
        assert seen[where]["UNRELATED_SETTING"] == "kept"
        assert SECRET not in json.dumps(seen[where]), where
        assert "CYCLONE_DATABASE_URL" not in seen[where]
        assert "PGPASSWORD" not in seen[where]


def test_a_database_refusal_at_start_is_one_line_without_the_password_and_exit_2(
    env, tmp_path
) -> None:
    # A read-only session: registering the workflows fails (not a connection error).
    read_only = "-c default_transaction_read_only=on"
    dsn = with_options(make_conninfo(env.dsn, password=SECRET), read_only)
    config = tmp_path / "c.toml"
    config.write_text(render_config({"workflows.modules": '["proc_secret_flows"]'}))
    done = subprocess.run(
        [sys.executable, "-m", "cyclone.supervisor", "--config", str(config)],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(HERE), "CYCLONE_DATABASE_URL": dsn},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.startswith("cyclone-supervisor:")]
    assert done.returncode == 2, done.stderr
    assert lines == [done.stderr.strip().splitlines()[-1]]
    assert "database refused: ReadOnlySqlTransaction" in lines[0]
    assert "Traceback" not in done.stderr and SECRET not in done.stderr + done.stdout

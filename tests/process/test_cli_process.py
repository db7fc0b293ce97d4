"""The `cyclone` console script as operators run it: in a pipe, and on a (pseudo-)terminal;
and `python -m cyclone.config --example`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from cli_support import ANSI, SECRET, approve, deadline_killed
from pty_helpers import clean_env, read_until, spawn_on_pty, stop

from cyclone.config import render_example
from cyclone.testing import TestEnv

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = shutil.which("cyclone", path=str(Path(sys.executable).parent)) or "cyclone"
# SGR sequences that set a colour: 30-37, 90-97 (fg), 40-47, 100-107 (bg), 38;/48; (extended).
_SGR = re.compile(r"\x1b\[([0-9;]*)m")


def colours(text: str) -> list[str]:
    found = []
    for params in _SGR.findall(text):
        codes = [int(p) for p in params.split(";") if p]
        if any(30 <= c <= 49 or 90 <= c <= 107 for c in codes):
            found.append(params)
    return found


@pytest.fixture
def cenv(env: TestEnv) -> TestEnv:
    env.register(approve)
    return env


def test_the_console_script_lists_the_deadline_dlq(cenv):
    killed = deadline_killed(cenv)
    out = subprocess.run(
        [SCRIPT, "--dsn", cenv.dsn, "dlq", "list", "--reason", "deadline"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert out.returncode == 0, out.stderr
    assert killed in out.stdout and "run deadline exceeded" in out.stdout
    assert not ANSI.search(out.stdout)


def test_the_console_script_exits_3_without_a_traceback_or_the_password():
    dsn = f"postgresql://ops:{SECRET}@127.0.0.1:1/cyclone"
    out = subprocess.run(
        [SCRIPT, "--dsn", dsn, "status"], capture_output=True, text=True, timeout=60,
        env=clean_env(),
    )  # fmt: skip
    assert out.returncode == 3
    assert "Traceback" not in out.stderr and SECRET not in out.stderr + out.stdout
    assert out.stderr.count("\n") == 1


def test_usage_errors_from_the_console_script_exit_2_without_a_traceback():
    out = subprocess.run(
        [SCRIPT, "dlq", "list", "--reason", "'; DROP TABLE x; --"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr and "invalid choice" in out.stderr


def test_status_piped_to_cat_prints_once_without_ansi(cenv):
    cenv.client.submit(approve, {}, run_deadline=timedelta(minutes=5))
    out = subprocess.run(
        f"'{SCRIPT}' --dsn \"$DSN\" status | cat",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(DSN=cenv.dsn, TERM="xterm-256color"),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("cyclone status") == 1 and "Runs" in out.stdout
    assert not ANSI.search(out.stdout)


def test_status_on_a_terminal_is_a_live_screen_that_ctrl_c_leaves_with_0(cenv):
    cenv.client.submit(approve, {}, run_deadline=timedelta(minutes=5))
    proc, primary = spawn_on_pty(cenv, "status", "--interval", "500ms")
    seen = bytearray()
    try:
        # Two renders of the header: the first screen and at least one refresh.
        assert read_until(primary, "cyclone status(.|\n)*cyclone status", seen, 30), seen[-2000:]
    finally:
        code = stop(proc, primary, seen)
    assert code == 0
    text = seen.decode(errors="replace")
    assert "Traceback" not in text
    assert "\x1b[" in text  # a terminal gets cursor movement for the redraw
    assert colours(text), "a terminal gets colour"


def test_no_color_keeps_colour_off_the_live_screen(cenv):
    proc, primary = spawn_on_pty(cenv, "status", "--interval", "500ms", NO_COLOR="1")
    seen = bytearray()
    try:
        assert read_until(primary, "cyclone status(.|\n)*cyclone status", seen, 30)
    finally:
        code = stop(proc, primary, seen)
    assert code == 0 and colours(seen.decode(errors="replace")) == []


def test_python_m_cyclone_config_example_prints_the_example() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cyclone.config", "--example"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == render_example()

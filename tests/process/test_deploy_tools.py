"""The deployment files in config/, checked by the tools that read them: promtool (alert rules,
scrape config, the rules' unit tests) and systemd-analyze (the unit), where they are installed
(they are in CI and on this project's dev image). tests/unit/test_cli_deploy.py checks the
same files without them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "config" / "prometheus"
UNIT = ROOT / "config" / "systemd" / "cyclone.service"


def test_the_alert_rules_pass_promtool_where_it_is_installed():
    """Without promtool, the structural checks above are what remains, and this says so."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed; on Debian: apt-get install prometheus (as .ci/run)")
    for argv in (
        ["promtool", "check", "rules", "alerts.yml"],
        ["promtool", "check", "config", "scrape.yml"],
        ["promtool", "test", "rules", "alerts_test.yml"],
    ):
        out = subprocess.run(argv, cwd=PROM, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


def test_systemd_analyze_accepts_the_unit_where_it_is_installed(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart exists: point it at the supervisor installed here.
    supervisor = Path(sys.executable).parent / "cyclone-supervisor"
    unit = tmp_path / "cyclone.service"
    unit.write_text(
        UNIT.read_text().replace("/opt/cyclone/bin/cyclone-supervisor", str(supervisor))
    )
    out = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr

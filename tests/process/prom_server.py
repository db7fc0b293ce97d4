"""A real Prometheus for the process tests: the shipped config, a scratch data dir, its HTTP API.

The shipped `config/prometheus/scrape.yml` is used as it is except where a test must differ:
the target (a supervisor on a free port instead of the example VMs) and the intervals (one
second instead of fifteen, so a test sees scrapes and rule evaluations within its patience).
`alerts.yml` is copied unchanged, `for:` durations and all: tests check alerts `pending`,
which an alert is from its first true evaluation, rather than wait minutes for `firing`.
Each substitution must match exactly, so a reworded scrape.yml fails here loudly instead of
being tested half-templated.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from proc_helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "config" / "prometheus"
# Where the binaries come from when missing: the README's test command skips, saying this.
INSTALL_HINT = "on Debian: apt-get install prometheus, which brings promtool, as .ci/run does"


def missing_binary(*names: str) -> str | None:
    """A skip reason naming the first of `names` not on PATH, or None when all are there."""
    for name in names:
        if shutil.which(name) is None:
            return f"{name} is not installed; {INSTALL_HINT}"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _substitute(text: str, old: str, new: str, count: int) -> str:
    found = text.count(old)
    if found != count:
        raise AssertionError(
            f"config/prometheus/scrape.yml: expected {old!r} {count} time(s), found {found}:"
            " the test templates the shipped file and must be updated with it"
        )
    return text.replace(old, new)


def render_scrape_config(targets: list[str], interval: str) -> str:
    """The shipped scrape.yml with these targets and every interval and timeout `interval`."""
    text = (SHIPPED / "scrape.yml").read_text()
    text = _substitute(text, "scrape_interval: 15s", f"scrape_interval: {interval}", 2)
    text = _substitute(text, "evaluation_interval: 15s", f"evaluation_interval: {interval}", 1)
    # A scrape timeout may not exceed the scrape interval.
    text = _substitute(text, "scrape_timeout: 5s", f"scrape_timeout: {interval}", 1)
    listed = "".join(f"          - {t}\n" for t in targets)
    shipped = "          - vm-1.internal:9464\n          - vm-2.internal:9464\n"
    return _substitute(text, shipped, listed, 1)


class Prometheus:
    """`prometheus` on a free loopback port, its data and its log under `tmp`."""

    def __init__(self, tmp: Path, targets: list[str], interval: str = "1s") -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.config = tmp / "prometheus.yml"
        self.config.write_text(render_scrape_config(targets, interval))
        # rule_files is relative to the config file: alerts.yml goes beside it, unchanged.
        shutil.copyfile(SHIPPED / "alerts.yml", tmp / "alerts.yml")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_for(self.ready, 30, f"prometheus to be ready\n{self.log()}", interval=0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        if self.popen.poll() is not None:
            pytest.fail(f"prometheus exited with {self.popen.returncode}\n{self.log()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        """`data` of a Prometheus HTTP API answer (its status checked)."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result: [{"metric": {labels}, "value": [time, "text"]}, ...]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def values(self, expr: str) -> dict[str, float]:
        """An instant query as {"label=value,...": value} (no __name__), for one assertion."""
        found = {}
        for r in self.query(expr):
            labels = sorted((k, v) for k, v in r["metric"].items() if k != "__name__")
            found[",".join(f"{k}={v}" for k, v in labels)] = float(r["value"][1])
        return found

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.popen.kill()
                self.popen.wait(10)

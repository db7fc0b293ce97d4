"""The deployment files in config/: alert rules (promtool), dashboard, systemd unit.

The metric names they use are checked against docs/operators.md's list always; promtool and
systemd-analyze run on the same files in tests/process/test_deploy_tools.py when they are
installed (they are in CI and on this project's dev image), so the files are never only
eyeballed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from cyclone.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "config" / "prometheus"
UNIT = ROOT / "config" / "systemd" / "cyclone.service"
DASHBOARD = ROOT / "config" / "grafana" / "cyclone.json"

# The metrics every supervisor has exported from the start (docs/operators.md, "Metrics and
# alerts"), each of which the dashboard shows; histograms add _bucket, _sum and _count.
CORE_METRICS = {
    "cyclone_leases_active",
    "cyclone_leases_total",
    "cyclone_lease_expirations_total",
    "cyclone_worker_kills_total",
    "cyclone_dlq_depth",
    "cyclone_steps_total",
    "cyclone_step_duration_seconds",
    "cyclone_runs_active",
    "cyclone_workers",
    "cyclone_worker_restarts_total",
    "cyclone_scanner_runs_failed_total",
    "cyclone_scanner_last_scan_timestamp_seconds",
}
# Added since, and Prometheus's own scrape health (`up`): whether the supervisor's database
# reads succeed (exported with the database gauges), the due steps, unserved runs, and the
# database's oldest transaction and transaction-ID age, schedules' ticks and lag, a read
# replica's lag.
EXTRA_METRICS = {
    "cyclone_db_up",
    "up",
    "cyclone_steps_due",
    "cyclone_steps_due_oldest_seconds",
    "cyclone_runs_unserved",
    "cyclone_db_oldest_xact_age_seconds",
    "cyclone_db_xid_age",
    "cyclone_db_replica_lag_seconds",
    "cyclone_dispatch_batch_steps",
    "cyclone_steps_throttled",
    "cyclone_schedule_ticks_total",
    "cyclone_schedule_lag_seconds",
}
HISTOGRAMS = {"cyclone_step_duration_seconds", "cyclone_dispatch_batch_steps"}
_NAME = re.compile(r"\b(cyclone_[a-z_]+|up)\b(?=\s*[{\[)]|\s*$|\s*[=!<>]|\s+(?:and|or|offset))")


def metric_names(expr: str) -> set[str]:
    names = set()
    for name in _NAME.findall(expr):
        for suffix in ("_bucket", "_sum", "_count"):
            base = name.removesuffix(suffix)
            if base != name and base in HISTOGRAMS:
                name = base
        names.add(name)
    return names


def alert_text() -> str:
    return (PROM / "alerts.yml").read_text()


def alert_rules() -> dict[str, str]:
    """alert name -> expr, read from alerts.yml (a fixed layout: `- alert:` then `expr:`)."""
    rules: dict[str, str] = {}
    current = None
    lines = (PROM / "alerts.yml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*- alert: (\w+)\s*$", line)
        if m:
            current = m.group(1)
            continue
        m = re.match(r"(\s*)expr: ?(.*)$", line)
        if m and current:
            expr, indent = m.group(2), len(m.group(1))
            if expr in (">-", "|", ">"):
                body = []
                for nxt in lines[i + 1 :]:
                    if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                        break
                    body.append(nxt.strip())
                expr = " ".join(body)
            rules[current] = expr
            current = None
    return rules


def test_alert_rules_cover_the_operator_alerts_with_spec_metric_names():
    rules = alert_rules()
    assert set(rules) == {
        "CycloneSupervisorDown",
        "CycloneDatabaseDown",
        "CycloneDLQGrowing",
        "CycloneDeadlineKillsHigh",
        "CycloneLeaseReclaimsHigh",
        "CycloneScannerStalled",
        "CycloneOldestAvailableStepTooOld",
        "CycloneRunsUnserved",
        "CycloneLongTransaction",
        "CycloneXidWraparoundRisk",
        "CycloneScheduleTicksMissed",
    }
    used = set()
    for name, expr in rules.items():
        found = metric_names(expr)
        assert found, name
        assert found <= CORE_METRICS | EXTRA_METRICS, (name, found - CORE_METRICS)
        used |= found
    assert "cyclone_db_up" in metric_names(rules["CycloneDatabaseDown"])
    assert "cyclone_scanner_last_scan_timestamp_seconds" in used
    text = (PROM / "alerts.yml").read_text()
    for field in ("for:", "severity:", "summary:", "description:"):
        assert text.count(field) >= len(rules), field


def test_docs_operators_md_lists_exactly_the_metrics_the_files_may_use():
    text = (ROOT / "docs" / "operators.md").read_text()
    section = text.split("## Metrics and alerts", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(cyclone_[a-z_]+)", section, re.MULTILINE))
    assert listed == (CORE_METRICS | EXTRA_METRICS) - {"up"}


def minutes(duration: str) -> float:
    number, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()
    return int(number) * {"s": 1 / 60, "m": 1, "h": 60}[unit]


def test_every_alert_has_a_firing_and_a_quiet_promtool_case():
    text = (PROM / "alerts_test.yml").read_text()
    cases = re.findall(r"eval_time: (\w+)\n\s+alertname: (\w+)\n\s+exp_alerts:( \[\])?", text)
    waits = dict(re.findall(r"- alert: (\w+)\n(?:.*\n)*?\s+for: (\w+)", alert_text()))
    assert set(waits) == set(alert_rules())
    for name in alert_rules():
        outcomes = {bool(empty) for _, alert, empty in cases if alert == name}
        assert outcomes == {True, False}, name
        # A quiet case before `for:` has passed proves nothing: nothing could fire yet.
        quiet = [minutes(at) for at, alert, empty in cases if alert == name and empty]
        assert max(quiet) > minutes(waits[name]), (name, quiet, waits[name])
    for series in re.findall(r"series: '([a-z_]+)\{", text):
        assert series in CORE_METRICS | EXTRA_METRICS, series


def test_the_dashboard_uses_only_documented_metrics_and_shows_the_core_ones():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = set().union(*(metric_names(e) for e in exprs))
    assert used <= CORE_METRICS | EXTRA_METRICS, used - CORE_METRICS - EXTRA_METRICS
    assert used >= CORE_METRICS, CORE_METRICS - used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"] == "Cyclone"
    # DB-wide gauges are exported by every supervisor: summing them would multiply them.
    for e in exprs:
        if "cyclone_dlq_depth" in e or "cyclone_runs_active" in e:
            assert not re.search(
                r"sum\s*(by\s*\([^)]*\))?\s*\(\s*cyclone_(dlq_depth|runs_active)", e
            )


def unit_settings() -> dict[str, str]:
    values = {}
    for line in UNIT.read_text().splitlines():
        m = re.match(r"([A-Za-z]+)=(.*)$", line)
        if m:
            values[m.group(1)] = m.group(2)
    return values


def test_the_systemd_unit_drains_within_its_stop_timeout():
    unit = unit_settings()
    assert unit["Type"] == "notify" and unit["NotifyAccess"] == "main"
    assert unit["KillMode"] == "mixed" and unit["Restart"] == "on-failure"
    defaults = load_config(None, env={}).supervisor
    assert int(unit["TimeoutStopSec"]) > defaults.shutdown_timeout + defaults.kill_grace
    assert unit["NoNewPrivileges"] == "yes" and unit["ProtectSystem"] == "strict"
    assert "LoadCredential=" in UNIT.read_text()
    assert "cyclone-supervisor --config" in unit["ExecStart"]


def test_the_systemd_unit_bounds_the_service_memory():
    unit = unit_settings()
    sizes = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    high, top = (int(unit[k][:-1]) * sizes[unit[k][-1]] for k in ("MemoryHigh", "MemoryMax"))
    assert 0 < high < top

"""A real Prometheus scrapes a real supervisor with the shipped scrape config and alert rules.

One scene for the module (a supervisor and a Prometheus cost seconds to start): a run killed by
its deadline, one killed by a cancel, eleven parked runs failed by their deadline (DLQ growth,
and more than the ten deadline failures CycloneDeadlineKillsHigh allows), runs that complete
(step durations), and one run left running (a lease held, a worker busy). The tests then ask
Prometheus's HTTP API, as an operator's dashboard or alert would. The last test kills the
supervisor, so it stays last in the file.

Skipped, saying why, where `prometheus` or `promtool` is not installed; .ci/run installs them.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from proc_helpers import SupervisorProcess, terminal, wait_for
from prom_server import ROOT, Prometheus, missing_binary

from cyclone.states import RunState
from cyclone.supervisor.children import KillReason
from cyclone.testing import TestEnv

pytestmark = pytest.mark.process

DASHBOARD = ROOT / "config" / "grafana" / "cyclone.json"
PARKED = 11  # CycloneDeadlineKillsHigh: more than 10 runs failed by their deadline in 15m
# What Grafana makes of $__rate_interval under the shipped 15 s scrape interval (4 scrapes).
RATE_INTERVAL = "1m"


@dataclass
class Scene:
    env: TestEnv
    sup: SupervisorProcess
    prom: Prometheus
    target: str  # the supervisor's host:port, Prometheus's `instance` label


def wait_equal(actual: Callable[[], object], expected: object, timeout: float, what: str) -> None:
    """Poll `actual()` until it equals `expected`; fail showing the last value."""
    seen = []

    def check():
        seen[:] = [actual()]
        return seen[0] == expected

    try:
        wait_for(check, timeout, what, interval=0.25)
    except pytest.fail.Exception:
        pytest.fail(f"{what}: expected {expected!r}, last saw {seen[0]!r}")


@pytest.fixture(scope="module")
def scene(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    reason = missing_binary("prometheus", "promtool")
    if reason:
        pytest.skip(reason)
    from proc_flows import busy, parked, stubborn

    tmp = tmp_path_factory.mktemp("prometheus-live")
    with TestEnv(dsn=pg_dsn) as env:
        sup = SupervisorProcess(env.dsn, tmp, "supervisor", {"supervisor.workers": "3"})
        prom = None
        try:
            sup.wait_ready(3)
            # Labelled series appear at their first observation, which rate() cannot see: one
            # completed run before the first scrape, so that the scene's own shows in rates.
            work = {"dir": str(tmp)}
            first = env.client.submit(busy, {**work, "n": 0, "sleep": 0})
            wait_for(lambda: terminal(env, first), 15, "a first run to complete")
            target = sup.metrics_url().removeprefix("http://").removesuffix("/metrics")
            prom = Prometheus(tmp / "prometheus", [target])
            # A scrape before the failures, so that increase() and delta() see them happen.
            wait_equal(
                lambda: prom.values(
                    'cyclone_scanner_runs_failed_total{reason="deadline"}'
                    ' + on (instance) cyclone_dlq_depth{reason="deadline"}'
                ),
                {f"instance={target}": 0.0}, 20, "a first scrape",
            )  # fmt: skip
            late = env.client.submit(stubborn, work, run_deadline=1.5)
            cancelled = env.client.submit(stubborn, work)
            held = env.client.submit(stubborn, work)
            waiting = env.client.submit_many(parked, [{}] * PARKED, run_deadline=1.5)
            done = env.client.submit(busy, {**work, "n": 1, "sleep": 0})  # step durations
            wait_for(lambda: (tmp / f"{cancelled}.1.pids").exists(), 15, "the handler to start")
            env.client.cancel(cancelled)
            ended = [late, cancelled, done, *waiting]
            wait_for(lambda: all(terminal(env, r) for r in ended), 20, "the runs to end")
            wait_for(lambda: (tmp / f"{held}.1.pids").exists(), 15, "the held run to start")
            wait_for(lambda: len(sup.workers()) == 3, 10, "the replacement workers")
            assert env.client.get_run(held).state == RunState.RUNNING
            yield Scene(env, sup, prom, target)
        finally:
            if prom is not None:
                prom.stop()
            sup.stop()


def health(prom: Prometheus) -> list[tuple[str, str]]:
    return [(t["labels"]["instance"], t["health"]) for t in prom.targets()]


def test_the_target_is_up_and_the_counts_match_what_happened(scene: Scene) -> None:
    prom, target = scene.prom, scene.target
    wait_equal(lambda: health(prom), [(target, "up")], 10, "the targets")
    labels = prom.targets()[0]["labels"]
    assert labels["job"] == "cyclone" and labels["cluster"] == "production"
    base = f"cluster=production,instance={target},job=cyclone"
    # The database gauges are cached for up to 5 s by the supervisor: poll, do not sample.
    expected = {
        "cyclone_worker_kills_total": {
            f"{base},reason={reason}": float(reason in ("deadline", "cancel"))
            for reason in map(str, KillReason)
        },
        'cyclone_dlq_depth{reason="deadline"}': {f"{base},reason=deadline": 1.0 + PARKED},
        'cyclone_scanner_runs_failed_total{reason="deadline"}': {
            f"{base},reason=deadline": 1.0 + PARKED
        },
        "cyclone_leases_active": {f"{base},workflow=proc-stubborn": 1.0},
        'cyclone_workers{state="busy"}': {f"{base},state=busy": 1.0},
        'up{job="cyclone"}': {base: 1.0},
    }
    for expr, values in expected.items():
        wait_equal(lambda e=expr: prom.values(e), values, 15, expr)


def test_the_deadline_kill_and_dlq_alerts_go_pending_and_no_other(scene: Scene) -> None:
    """`for:` is as shipped (5m, 15m), so these alerts are pending, not firing, in a test."""
    prom = scene.prom

    def active() -> set[tuple[str, str, str]]:
        return {
            (a["labels"]["alertname"], a["labels"].get("reason", ""), a["state"])
            for a in prom.alerts()
        }

    wait_equal(
        active,
        {
            ("CycloneDeadlineKillsHigh", "", "pending"),
            ("CycloneDLQGrowing", "deadline", "pending"),
        },
        20, "the active alerts",
    )  # fmt: skip
    kills = next(a for a in prom.alerts() if a["labels"]["alertname"] == "CycloneDeadlineKillsHigh")
    assert float(kills["value"]) > 10 and kills["labels"]["severity"] == "warning"


def test_promtool_finds_nothing_to_report_in_a_busy_supervisors_scrape(scene: Scene) -> None:
    text = scene.sup.metrics()
    # Busy: a lease held, kills and dead steps counted, histogram observed.
    assert 'cyclone_workers{state="busy"} 1.0' in text
    assert 'cyclone_leases_active{workflow="proc-stubborn"} 1.0' in text
    assert 'cyclone_worker_kills_total{reason="deadline"} 1.0' in text
    assert "cyclone_step_duration_seconds_bucket{" in text
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def grafana_regex(values: list[str]) -> str:
    """A multi-value variable as Grafana writes it into a PromQL regex matcher."""
    escaped = [re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [
        (f"{p['title']} [{t.get('legendFormat') or p['id']}]", t["expr"])
        for p in dash["panels"]
        for t in p.get("targets", [])
    ]


def test_every_dashboard_query_returns_data_for_all_and_for_chosen_values(scene: Scene) -> None:
    prom = scene.prom
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"datasource", "instance", "workflow"}
    # The variables' own queries: label_values(METRIC, LABEL) through the labels API.
    chosen = {}
    for name in ("instance", "workflow"):
        found = re.fullmatch(r"label_values\((.+), (\w+)\)", variables[name]["definition"])
        assert found, variables[name]["definition"]
        chosen[name] = prom.label_values(found.group(2), found.group(1))
    assert chosen == {"instance": [scene.target], "workflow": ["proc-busy", "proc-stubborn"]}
    queries = dashboard_queries()
    assert len(queries) >= 18
    for selection in ("all", "chosen"):
        values = {
            name: variables[name]["allValue"] if selection == "all" else grafana_regex(chosen[name])
            for name in chosen
        }
        empty, undefined = [], []
        for title, expr in queries:
            promql = expr.replace("$__rate_interval", RATE_INTERVAL)
            for name, value in values.items():
                promql = promql.replace(f"${name}", value)
            assert "$" not in promql, promql
            result = prom.query(promql)
            if not result:
                empty.append(f"{title}: {promql}")
            elif any(math.isnan(float(r["value"][1])) for r in result):
                undefined.append(f"{title}: {promql}")
        assert not empty, f"{selection}: panels without data:\n" + "\n".join(empty)
        assert not undefined, f"{selection}: panels with NaN:\n" + "\n".join(undefined)


def test_a_killed_supervisor_is_a_down_target_and_goes_pending_as_down(scene: Scene) -> None:
    """Last in the module: the supervisor does not come back."""
    prom, target = scene.prom, scene.target
    scene.sup.stop()  # SIGKILL, and the workers' process groups with it
    wait_equal(lambda: health(prom), [(target, "down")], 10, "the targets")
    assert prom.targets()[0]["lastError"]
    down = {f"cluster=production,instance={target},job=cyclone": 0.0}
    wait_equal(lambda: prom.values('up{job="cyclone"}'), down, 10, "up == 0")
    wait_for(
        lambda: [
            a for a in prom.alerts()
            if a["labels"]["alertname"] == "CycloneSupervisorDown"
            and a["labels"]["instance"] == target and a["state"] == "pending"
        ],
        10, f"CycloneSupervisorDown pending for {target}",
    )  # fmt: skip

"""Metric label values from registered names are capped: past the cap, they count as `other`."""

from __future__ import annotations

import re
from dataclasses import replace

from prometheus_client import generate_latest

from cyclone.supervisor.children import HeldLease, Role, WorkerHandle
from cyclone.supervisor.gauges import DatabaseGauges, Reading
from cyclone.supervisor.labels import MAX_NODES, MAX_WORKFLOWS, OTHER, LabelCap, top
from cyclone.supervisor.metrics import Metrics

LEASE = HeldLease(
    step_id=1, token="t", run_id="r", workflow="w", node="n", attempt=1,
    leased_at=0.0, timeout_at=None, deadline_at=None,
)  # fmt: skip


def values(text: str, metric: str, label: str) -> dict[str, float]:
    """label value -> sample, for one metric's samples in an exposition."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            value = re.search(label + r'="([^"]*)"', line)
            assert value is not None, line
            found[value.group(1)] = found.get(value.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def test_a_label_keeps_its_first_values_and_counts_the_rest_as_other() -> None:
    cap = LabelCap(3)
    assert [cap(v) for v in ("a", "b", "a", "c", "d", "b", "e")] == [
        "a", "b", "a", "c", OTHER, "b", OTHER,
    ]  # fmt: skip


def test_top_keeps_the_largest_and_sums_the_rest_once() -> None:
    assert list(top({"a": 5, "b": 1, "c": 3}, 2)) == [("a", 5), ("c", 3), (OTHER, 1)]
    assert list(top({"a": 5, "b": 1}, 2)) == [("a", 5), ("b", 1)]
    # A workflow really named "other" and the aggregate share one sample, never two.
    assert list(top({"other": 4, "b": 1, "c": 1}, 1)) == [("other", 6)]


def test_step_counters_have_at_most_the_cap_of_workflows_and_nodes_plus_other() -> None:
    metrics = Metrics()
    extra = 7
    for i in range(MAX_WORKFLOWS + extra):
        lease = replace(LEASE, workflow=f"wf-{i}", node="n")
        metrics.leased(lease)
        metrics.finished(lease, "completed", 0.1)
    for i in range(MAX_NODES + extra):
        metrics.leased(replace(LEASE, workflow="wf-0", node=f"node-{i}"))
    text = generate_latest(metrics.registry).decode()
    leased = values(text, "cyclone_leases_total", "workflow")
    assert len(leased) == MAX_WORKFLOWS + 1
    assert leased[OTHER] == extra
    assert leased["wf-0"] == 1 + MAX_NODES + extra
    steps = values(text, "cyclone_steps_total", "workflow")
    assert len(steps) == MAX_WORKFLOWS + 1 and steps[OTHER] == extra
    durations = values(text, "cyclone_step_duration_seconds_count", "workflow")
    assert len(durations) == MAX_WORKFLOWS + 1 and durations[OTHER] == extra
    nodes = values(text, "cyclone_leases_total", "node")
    assert len(nodes) == MAX_NODES + 1
    # "n" came first; MAX_NODES - 1 of the node-i names fit, the others count as other.
    assert nodes[OTHER] == extra + 1
    # A name admitted before the cap filled keeps its own series afterwards.
    metrics.leased(replace(LEASE, workflow="wf-1", node="n"))
    text = generate_latest(metrics.registry).decode()
    assert values(text, "cyclone_leases_total", "workflow")["wf-1"] == 2


def test_active_leases_show_the_busiest_workflows_and_the_rest_as_other() -> None:
    metrics = Metrics()
    children = {}
    for i in range(MAX_WORKFLOWS + 3):
        handle = WorkerHandle(
            pid=i, role=Role.WORKER, number=i, generation=0, fd=-1, spawned_at=0.0,
            last_seen=0.0, lease=replace(LEASE, workflow=f"wf-{i:03d}"),
        )  # fmt: skip
        children[i] = handle
    children[-1] = replace(children[0], pid=-1)  # wf-000 twice: the busiest
    metrics.watch(children)
    active = values(generate_latest(metrics.registry).decode(), "cyclone_leases_active", "workflow")
    assert len(active) == MAX_WORKFLOWS + 1
    assert active["wf-000"] == 2
    assert active[OTHER] == 3
    assert sum(active.values()) == MAX_WORKFLOWS + 4


def test_unserved_runs_by_workflow_are_capped() -> None:
    unserved = {f"client-wf-{i} {i:032x}": 1 for i in range(MAX_WORKFLOWS + 50)}
    reading = Reading(at=0.0, up=True, unserved=unserved)
    (family,) = [f for f in DatabaseGauges.families(reading) if f.name == "cyclone_runs_unserved"]
    labels = [sample.labels["workflow"] for sample in family.samples]
    assert len(labels) == len(set(labels)) == MAX_WORKFLOWS + 1
    assert sum(sample.value for sample in family.samples) == MAX_WORKFLOWS + 50
    # Each sample names the version its runs need; those past the cap are `other`.
    graphs = {sample.labels["workflow"]: sample.labels["graph"] for sample in family.samples}
    assert graphs["client-wf-0"] == f"{0:032x}" and graphs[OTHER] == OTHER

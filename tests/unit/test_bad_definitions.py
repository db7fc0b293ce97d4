"""A bad workflow definition is refused when it is written, with a GraphError naming the node
(docs/api.md). No database: bad input at run time is in tests/db/test_bad_input.py."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

import cyclone
from cyclone import GraphError
from cyclone.workflow import Graph, NodeSpec


def test_a_node_after_an_unknown_name_is_rejected_naming_both_nodes() -> None:
    wf = cyclone.Workflow("bad-graph-unknown")

    @wf.task()
    def a(ctx: Any) -> int:
        return 1

    with pytest.raises(GraphError, match=r"node 'b' runs after unknown node 'nope'"):

        @wf.task(after=[a, "nope"])
        def b(ctx: Any) -> int:
            return 2

    with pytest.raises(GraphError, match=r"'gate'.*unknown node 'missing'"):
        wf.wait("gate", after=["missing"])
    with pytest.raises(GraphError, match=r"'nap'.*unknown node 'missing'"):
        wf.sleep("nap", 5, after="missing")
    assert list(wf.nodes) == ["a"], "a rejected node was still added"


def test_a_node_cannot_run_after_itself_or_a_node_defined_later() -> None:
    wf = cyclone.Workflow("bad-graph-order")
    with pytest.raises(GraphError, match=r"node 'loop' runs after unknown node 'loop'"):
        wf.wait("loop", after=["loop"])


def test_a_duplicate_node_name_is_rejected_naming_the_node() -> None:
    wf = cyclone.Workflow("bad-graph-duplicate")

    @wf.task()
    def step(ctx: Any) -> int:
        return 1

    with pytest.raises(GraphError, match=r"node 'step' is defined twice"):
        wf.task(lambda ctx: 2, name="step")
    with pytest.raises(GraphError, match=r"node 'step' is defined twice"):
        wf.wait("step")
    with pytest.raises(GraphError, match=r"node 'step' is defined twice"):
        wf.sleep("step", 1)
    assert wf.nodes["step"] is step


def test_a_node_after_a_node_of_another_workflow_is_rejected_naming_both() -> None:
    other = cyclone.Workflow("bad-graph-other")

    @other.task()
    def theirs(ctx: Any) -> int:
        return 1

    wf = cyclone.Workflow("bad-graph-mine")
    with pytest.raises(GraphError, match=r"node 'mine' runs after 'theirs'.*'bad-graph-other'"):

        @wf.task(after=[theirs])
        def mine(ctx: Any) -> int:
            return 2

    assert not wf.nodes


def test_a_cycle_in_a_stored_graph_is_rejected_naming_a_node_of_the_cycle() -> None:
    specs = [
        NodeSpec(name="a", kind=cyclone.NodeKind.TASK, after=("b",)),
        NodeSpec(name="b", kind=cyclone.NodeKind.TASK, after=("a",)),
    ]
    with pytest.raises(GraphError, match=r"node '[ab]' is part of a cycle"):
        Graph.build("bad-graph-cycle", specs)


@pytest.mark.parametrize("max_attempts", [0, -1, True, False, 1.5, "3", None])
def test_max_attempts_that_is_not_a_positive_integer_is_rejected_naming_the_node(
    max_attempts: Any,
) -> None:
    wf = cyclone.Workflow("bad-graph-attempts")
    with pytest.raises(GraphError, match=r"node 'flaky': max_attempts"):
        wf.task(lambda ctx: 1, name="flaky", max_attempts=max_attempts)
    assert not wf.nodes


@pytest.mark.parametrize("timeout", [-1, -0.001, dt.timedelta(seconds=-1)])
def test_a_negative_timeout_is_rejected_naming_the_node(timeout: Any) -> None:
    wf = cyclone.Workflow("bad-graph-timeout")
    with pytest.raises(GraphError, match=r"node 'slow': timeout: must not be negative"):
        wf.task(lambda ctx: 1, name="slow", timeout=timeout)
    assert not wf.nodes


@pytest.mark.parametrize("timeout", ["30s", [1], True])
def test_a_timeout_that_is_not_a_duration_is_rejected_naming_the_node(timeout: Any) -> None:
    wf = cyclone.Workflow("bad-graph-timeout-type")
    with pytest.raises(GraphError, match=r"node 'slow': timeout: expected a timedelta"):
        wf.task(lambda ctx: 1, name="slow", timeout=timeout)


def test_negative_max_wait_and_sleep_duration_are_rejected_naming_the_node() -> None:
    wf = cyclone.Workflow("bad-graph-waits")
    with pytest.raises(GraphError, match=r"node 'gate': max_wait: must not be negative"):
        wf.wait("gate", max_wait=-5)
    with pytest.raises(GraphError, match=r"node 'nap': duration: must not be negative"):
        wf.sleep("nap", dt.timedelta(minutes=-1))
    assert not wf.nodes


@pytest.mark.parametrize("name", ["", " padded ", None, 7])
def test_an_invalid_node_name_is_rejected(name: Any) -> None:
    wf = cyclone.Workflow("bad-graph-names")
    with pytest.raises(GraphError, match="invalid node name"):
        wf.wait(name)

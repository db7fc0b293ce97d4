"""NaN, infinity and 1e300 are floats, not durations: a node's timeout, max_wait or sleep
given one is refused when the workflow is defined, naming the node (issue 22, item 14; they
failed later, in the database, with its own error)."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

import cyclone
from cyclone.errors import GraphError
from cyclone.states import MAX_DEADLINE_SECONDS

BAD = [math.nan, math.inf, 1e300, MAX_DEADLINE_SECONDS + 1]


@pytest.mark.parametrize("value", BAD)
def test_a_timeout_that_is_no_duration_is_refused_naming_the_node(value: float):
    wf = cyclone.Workflow("bad-duration-task")
    with pytest.raises(GraphError, match=r"node 'slow': timeout: .* not a usable duration"):
        wf.task(name="slow", timeout=value)(lambda ctx: None)
    with pytest.raises(GraphError, match=r"node 'many': timeout: .* not a usable duration"):
        wf.map(name="many", items=lambda ctx: [], timeout=value)(lambda ctx: None)


@pytest.mark.parametrize("value", BAD)
def test_a_sleep_or_max_wait_that_is_no_duration_is_refused_naming_the_node(value: float):
    wf = cyclone.Workflow("bad-duration-wait")
    with pytest.raises(GraphError, match=r"node 'nap': duration: .* not a usable duration"):
        wf.sleep("nap", value)
    with pytest.raises(GraphError, match=r"node 'gate': max_wait: .* not a usable duration"):
        wf.wait("gate", max_wait=value)


def test_a_hundred_years_is_still_a_duration():
    wf = cyclone.Workflow("long-durations")
    wf.sleep("nap", timedelta(seconds=MAX_DEADLINE_SECONDS))
    wf.task(name="slow", timeout=MAX_DEADLINE_SECONDS)(lambda ctx: None)

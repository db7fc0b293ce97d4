"""loads_flat reads what json.loads reads, and refuses what it refuses, without recursion: the
dispatcher's way through an answer nested too deep for json (issue 22, item 3)."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone.db import loads_flat

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(value=json_values, indent=st.sampled_from([None, 0, 2]))
def test_it_reads_any_json_as_json_loads_does(value, indent):
    text = json.dumps(value, indent=indent)
    assert loads_flat(text) == json.loads(text)


@pytest.mark.parametrize(
    "text", ["", "[1,]", '{"a" 1}', "[1 2]", '{"a":1,}', "nul", "[1]]", "{1:2}", "01", "[", '"x']
)
def test_it_refuses_what_is_not_json(text):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        loads_flat(text)


def test_it_reads_a_document_far_deeper_than_the_recursion_limit():
    depth = 20 * sys.getrecursionlimit()
    found = loads_flat('{"a":' + "[" * depth + "1" + "]" * depth + "}")
    value = found["a"]
    for _ in range(depth):
        value = value[0]
    assert value == 1

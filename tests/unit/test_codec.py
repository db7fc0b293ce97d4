"""cyclone.codec reads and writes what the json module does, orjson or not (issue 23, item 5)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cyclone import codec

# JSON values as the lines carry them, with integers past 64 bits and text past ASCII.
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@given(value=values)
def test_what_it_writes_json_reads_back_and_what_json_writes_it_reads(value: object) -> None:
    assert json.loads(codec.dumps(value)) == value
    assert codec.loads(json.dumps(value)) == value
    assert codec.loads(json.dumps(value).encode()) == value


def test_it_reads_what_only_the_json_module_takes() -> None:
    assert math.isnan(codec.loads('{"x": NaN}')["x"])
    assert codec.loads(str(2**70)) == 2**70


@pytest.mark.parametrize("text", ["", "{", '{"a": }', "[1,]", "nul"])
def test_malformed_text_raises_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        codec.loads(text)


@pytest.mark.parametrize(
    "text",
    [
        "12345678901234567890123", "-9223372036854775809", " 18446744073709551616",
        "[1,-12345678901234567890123]", '{"a":\t98765432109876543210}',
        "[\n1234567890123456789012]",
        '{"duration":0.00041234567890123456,"n":123456789012345678901}',
    ],
)  # fmt: skip
def test_an_integer_past_64_bits_stays_whole_wherever_it_stands(text: str) -> None:
    assert codec.loads(text) == json.loads(text)
    assert codec.loads(text.encode()) == json.loads(text)


@pytest.mark.parametrize(
    "text", ["0.00041234567890123456", "[1.5e0000000000000000001, 0.000123456789012345678]"]
)
def test_long_fractions_and_exponents_read_as_json_reads_them(text: str) -> None:
    assert codec.loads(text) == json.loads(text)

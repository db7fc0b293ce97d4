"""JSON on the hot paths (the supervisor's dispatch answers, the lines between supervisor and
workers): orjson where it can, the standard library where it cannot.

orjson reads and writes these several times faster than the `json` module (bench/README.md,
"What JSON costs a step"): the lines a step sends across are internal, their values strings,
numbers, booleans, nulls, and the JSON values PostgreSQL stored. What orjson refuses and `json`
takes (integers past 64 bits in a run's input, NaN in a hand-written line) goes through `json`,
so the two read and write the same values; malformed text raises what `json` raises.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_DECODER = json.JSONDecoder()
_ENCODER = json.JSONEncoder(separators=(",", ":"))
# orjson reads an integer past 64 bits as a float, silently: text with a run of 19 digits or
# more (a uuid or hash seldom has one) goes to `json`, which keeps it whole.
_LONG = re.compile(r"\d{19}")
_LONG_BYTES = re.compile(rb"\d{19}")


def loads(text: str | bytes) -> Any:
    """Parse one JSON value (ValueError or RecursionError as `json.loads` raises them)."""
    if isinstance(text, str):
        if _LONG.search(text) is None:
            try:
                return orjson.loads(text)
            except orjson.JSONDecodeError:
                pass
        return _DECODER.decode(text)
    if _LONG_BYTES.search(text) is None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return _DECODER.decode(text.decode())


def dumps(value: Any) -> str:
    """One JSON value, compact."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return _ENCODER.encode(value)

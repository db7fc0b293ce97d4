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
from typing import Any

import orjson

_DECODER = json.JSONDecoder()
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def loads(text: str | bytes) -> Any:
    """Parse one JSON value (ValueError or RecursionError as `json.loads` raises them)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return _DECODER.decode(text if isinstance(text, str) else text.decode())


def dumps(value: Any) -> str:
    """One JSON value, compact."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return _ENCODER.encode(value)

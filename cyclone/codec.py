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
# orjson reads an integer past 64 bits as a float, silently: text with an integer of 19 digits
# or more goes to `json`, which keeps it whole. Such a run is looked for in a copy of the bytes
# with every digit made b"0", every byte a fraction or an exponent follows made b"." (the digits
# after "0." of a small float, a duration, run that long) and every other byte b" ": a regex
# (\d{19}) scanned the text a character at a time, several times slower than orjson's whole
# parse (bench/README.md, "Python CPU a step"). A run inside a string may send text to `json`
# for nothing; an integer is never missed.
_MARKS = bytes(
    0x30 if 0x30 <= b <= 0x39 else 0x2E if b in b".eE" else 0x20 for b in range(256)
)
_RUN = b"0" * 19
_INTEGER = b" " + _RUN


def _long_run(data: bytes) -> bool:
    marked = data.translate(_MARKS)
    return _INTEGER in marked or marked.startswith(_RUN)


def loads(text: str | bytes) -> Any:
    """Parse one JSON value (ValueError or RecursionError as `json.loads` raises them)."""
    if isinstance(text, str):
        try:
            data = text.encode()
        except UnicodeEncodeError:  # a lone surrogate: not orjson's to read
            return _DECODER.decode(text)
        if not _long_run(data):
            try:
                return orjson.loads(data)
            except orjson.JSONDecodeError:
                pass
        return _DECODER.decode(text)
    if not _long_run(text):
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

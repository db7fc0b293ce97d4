"""Durations as operators write them: "500ms", "30s", "5m", "2h", "7d", "1h30m", or seconds.

The config file, the CLI's arguments and the reference read them with `parse_duration`; the
example config and messages write them back with `format_duration`.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from decimal import Decimal

from cyclone.redact import show_value

_UNITS = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600)}
_UNITS["d"] = Decimal(86400)
# ASCII digits only: \d would also take "٣", which no operator means.
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")
_DURATION = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?(?:ms|s|m|h|d))+")
_PLAIN_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")
# Beyond this, timedelta arithmetic downstream overflows; no Cyclone timer needs a century.
MAX_DURATION = 36500 * 86400.0
DURATION_HELP = 'a number of seconds or a string like "500ms", "30s", "5m", "2h", "7d", "1h30m"'


class DurationOutOfRange(ValueError):
    """A duration that reads as one but is negative or too long: `why` says which, for a
    message that names it (the config's "expected a duration, got -5s" did not)."""

    def __init__(self, value: object, why: str) -> None:
        self.why = why
        super().__init__(f"invalid duration {show_value(value)}: {why}")


def parse_duration(value: object) -> float:
    """Return `value` in seconds: "500ms", "30s", "5m", "2h", "7d", "1h30m", or a number >= 0."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float | str):
        # TOML `true` is a Python int; a boolean where a duration belongs is always a mistake.
        raise ValueError(f"invalid duration {show_value(value)}: expected {DURATION_HELP}")
    elif isinstance(value, str):
        text = value.strip()
        if len(text) > 400:  # bounds the Decimal arithmetic below (it traps on huge exponents)
            raise ValueError(f"invalid duration {show_value(value)}: too long")
        if text[:1] == "-" and (_PLAIN_NUMBER.fullmatch(text[1:]) or _DURATION.fullmatch(text[1:])):
            raise DurationOutOfRange(value, "must not be negative")
        if _PLAIN_NUMBER.fullmatch(text):
            seconds = float(Decimal(text))
        elif _DURATION.fullmatch(text):
            # Decimal sums exactly, so "1h30m500ms" rounds once, like the number it names.
            total = sum(Decimal(n) * _UNITS[u] for n, u in _PART.findall(text))
            seconds = float(total)
        else:
            raise ValueError(f"invalid duration {show_value(value)}: expected {DURATION_HELP}")
    elif value != value:  # NaN
        raise ValueError(f"invalid duration {show_value(value)}: expected {DURATION_HELP}")
    else:
        # Compare before float(): a huge TOML integer would overflow the conversion.
        seconds = float(value) if value <= MAX_DURATION else math.inf
    if seconds < 0:
        raise DurationOutOfRange(value, "must not be negative")
    if seconds > MAX_DURATION:
        raise DurationOutOfRange(value, "longer than 36500d")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest string `parse_duration` reads back as exactly `seconds` ("1h30m", "500ms")."""
    millis = round(seconds * 1000)
    if float(Decimal(millis) / 1000) != seconds:
        return format(Decimal(repr(float(seconds))), "f") + "s"
    parts = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        count, millis = divmod(millis, size)
        if count:
            parts.append(f"{count}{unit}")
    if millis or not parts:
        parts.append(f"{millis}ms" if millis else "0s")
    return "".join(parts)

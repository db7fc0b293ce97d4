"""The console's query strings and form fields, checked: bad input is one clear message
naming the field, and nothing is read or changed."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from cyclone.durations import parse_duration
from cyclone.states import MAX_DEADLINE_SECONDS, ErrorKind, RunState

MAX_TEXT = 200  # characters of a filter's text
MAX_SELECTED = 500  # runs or steps one bulk action takes


class BadInput(ValueError):
    """A field the console cannot take; the message names it and says what it expects."""


def text(query: Mapping[str, str], name: str) -> str | None:
    value = (query.get(name) or "").strip()
    if not value:
        return None
    if len(value) > MAX_TEXT:
        raise BadInput(f"{name}: at most {MAX_TEXT} characters, got {len(value)}")
    if "\x00" in value:
        raise BadInput(f"{name}: contains a NUL character")
    return value


def choice(query: Mapping[str, str], name: str, choices: list[str]) -> str | None:
    value = text(query, name)
    if value is not None and value not in choices:
        raise BadInput(f"{name}: expected one of {', '.join(choices)}, got {value[:40]!r}")
    return value


def run_state(query: Mapping[str, str]) -> str | None:
    return choice(query, "state", [s.value for s in RunState])


def reason(query: Mapping[str, str]) -> str | None:
    return choice(query, "reason", [k.value for k in ErrorKind])


def moment(query: Mapping[str, str], name: str, now: datetime) -> datetime | None:
    """A time: a duration ago ("1h", "7d") or an ISO 8601 date or time (UTC unless it says)."""
    value = text(query, name)
    if value is None:
        return None
    try:
        return now - timedelta(seconds=parse_duration(value))
    except (ValueError, ArithmeticError):
        pass
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(
            f'{name}: expected a duration ago like "1h" or "7d", or a time like '
            f'"2026-12-01T10:00" (UTC), got {value[:40]!r}'
        ) from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def run_cursor(query: Mapping[str, str]) -> tuple[datetime, str] | None:
    return _cursor(query, lambda rid: str(uuid.UUID(rid)))


def step_cursor(query: Mapping[str, str]) -> tuple[datetime, int] | None:
    return _cursor(query, _step_id)


def _cursor(query: Mapping[str, str], parse_id: Callable[[str], Any]) -> Any:
    """A page cursor as cursor_text wrote it: the last row's time and id."""
    value = text(query, "before")
    if value is None:
        return None
    at, _, key = value.partition("~")
    try:
        return datetime.fromisoformat(at), parse_id(key)
    except ValueError:
        raise BadInput("before: not a page cursor of this console") from None


def cursor_text(cursor: tuple[Any, Any]) -> str:
    return f"{cursor[0].isoformat()}~{cursor[1]}"


def run_id(value: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise BadInput(f"not a run id (a UUID): {value[:40]!r}") from None


def _step_id(value: str) -> int:
    if not value.isascii() or not value.isdigit() or not 0 < int(value) < 2**63:
        raise ValueError(value)
    return int(value)


def run_ids(values: list[str]) -> list[str]:
    ids = list(dict.fromkeys(run_id(v) for v in values))
    _check_count(ids, "run")
    return ids


def step_ids(values: list[str]) -> list[int]:
    ids = []
    for v in values:
        try:
            ids.append(_step_id(v))
        except ValueError:
            raise BadInput(f"not a step id (a positive whole number): {v[:40]!r}") from None
    ids = list(dict.fromkeys(ids))
    _check_count(ids, "step")
    return ids


def _check_count(ids: list[Any], what: str) -> None:
    if not ids:
        raise BadInput(f"no {what} selected: tick at least one")
    if len(ids) > MAX_SELECTED:
        raise BadInput(f"at most {MAX_SELECTED} {what}s at once, got {len(ids)}")


def deadline(value: str | None) -> float | None:
    """A retry's new run deadline, from now: a duration > 0, or empty for none."""
    value = (value or "").strip()
    if not value:
        return None
    try:
        seconds = parse_duration(value)
    except (ValueError, ArithmeticError) as exc:
        raise BadInput(f"deadline: {exc}") from None
    if not 0 < seconds <= MAX_DEADLINE_SECONDS:
        raise BadInput(f"deadline: expected a duration longer than zero, got {value[:40]!r}")
    return seconds


def back(value: str | None, default: str) -> str:
    """Where to go after an action: a path of this console only (never another site)."""
    value = value or ""
    if (
        value.startswith("/")
        and not value.startswith("//")
        and "\\" not in value
        and all(32 < ord(c) < 127 for c in value)
    ):
        return value
    return default

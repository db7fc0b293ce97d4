"""Schedules as values: what one says (`ScheduleSpec`), checked once, and the ticks it gives.

The engine (cyclone/engine/schedules.py) stores specs as rows of cyclone_schedules and the
scanner's `schedules` sweep starts their runs; this module knows nothing of the database, so
the client, `Workflow.schedule` and the sweep all check and compute ticks the same way.

Cron expressions are read by cronsim (5 fields, plus the usual `@daily`-style names, which
are mapped to their 5 fields here): it matches Debian cron, DST included. A local time that
a spring-forward skips fires once, at the next valid instant; one that a fall-back repeats
fires once (its first occurrence). Intervals tick on multiples of their length since the
Unix epoch, so every VM that upserts the same schedule computes the same ticks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from cyclone.errors import ConfigError


class Overlap(StrEnum):
    """What a tick does while the schedule's previous run is still active."""

    SKIP = "skip"  # the tick is skipped (counted)
    BUFFER_ONE = "buffer_one"  # at most one tick waits; it starts when the run ends
    BUFFER_ALL = "buffer_all"  # every tick waits, and they start one after another
    CANCEL_OTHER = "cancel_other"  # the active run is cancelled, the tick starts
    ALLOW_ALL = "allow_all"  # the tick starts anyway


# The cron names cronsim does not read, as the 5 fields they stand for.
CRON_NAMES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
MIN_INTERVAL = 1.0  # seconds; a shorter one would tick faster than a scanner pass
MAX_NAME = 100
DEFAULT_CATCHUP = timedelta(hours=1)
# A scanner pass may start a tick a few seconds late: a shorter window would miss ticks that
# were merely late, not missed.
MIN_CATCHUP = 10.0
# buffer_all keeps at most this many ticks waiting; more are skipped (and counted), so a
# schedule whose runs never end cannot grow its row without bound.
MAX_BUFFERED = 100
# A sweep or a backfill computes at most this many ticks of one schedule at once.
MAX_TICKS = 10_000


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """A schedule as declared: checked by `schedule_spec`, stored by the engine's upsert."""

    name: str
    workflow: str
    cron: str | None
    every: float | None  # seconds
    timezone: str
    input: Any
    overlap: Overlap
    catchup_window: float  # seconds
    jitter: float  # seconds
    run_deadline: float  # seconds, 0: none

    def ticks_after(self, after: datetime) -> Iterator[datetime]:
        """The ticks strictly after `after` (aware), in UTC, in order."""
        return ticks_after(self.cron, self.every, self.timezone, after)

    def first_tick_after(self, after: datetime) -> datetime:
        return next(self.ticks_after(after))

    def jitter_of(self, tick: datetime) -> timedelta:
        return jitter_of(self.name, self.jitter, tick)


def _seconds(value: Any, what: str, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise ConfigError(f"{what}: expected a timedelta or seconds, got {value!r}")
    secs = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(secs) or secs < minimum or secs > 100 * 365 * 86400:
        raise ConfigError(f"{what}: expected at least {minimum:g} s (and at most 100 years), "
                          f"got {value!r}")  # fmt: skip
    return secs


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or name != name.strip() or len(name) > MAX_NAME:
        raise ConfigError(f"schedule name: expected 1 to {MAX_NAME} characters with no "
                          f"surrounding spaces, got {name!r}")  # fmt: skip
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ConfigError(f"schedule name: contains a control character: {name!r}")
    return name


def check_cron(cron: Any) -> str:
    """The 5 fields of a cron expression (a name like @daily mapped); ConfigError if bad."""
    if not isinstance(cron, str):
        raise ConfigError(f"cron: expected a string, got {cron!r}")
    expr = CRON_NAMES.get(cron.strip().lower(), cron.strip())
    if len(expr.split()) != 5:
        raise ConfigError(
            f"cron: expected 5 fields (minute hour day month weekday) or one of "
            f"{', '.join(CRON_NAMES)}, got {cron!r}"
        )
    try:
        CronSim(expr, datetime(2000, 1, 1))
    except (CronSimError, ValueError) as e:
        raise ConfigError(f"cron: {cron!r} is not a valid expression ({e})") from None
    return expr


def check_timezone(timezone: Any) -> str:
    if not isinstance(timezone, str) or not timezone:
        raise ConfigError(f"timezone: expected an IANA zone name, got {timezone!r}")
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"timezone: unknown zone {timezone!r} (an IANA name such as "
                          "'Europe/Berlin' or 'UTC')") from None  # fmt: skip
    return timezone


def schedule_spec(
    name: Any,
    workflow: str,
    *,
    cron: Any = None,
    every: Any = None,
    timezone: Any = "UTC",
    input: Any = None,
    overlap: Any = Overlap.SKIP,
    catchup_window: Any = DEFAULT_CATCHUP,
    jitter: Any = None,
    run_deadline: Any = None,
) -> ScheduleSpec:
    """A checked ScheduleSpec; ConfigError (a ValueError) naming the first thing wrong."""
    check_name(name)
    if (cron is None) == (every is None):
        raise ConfigError(f"schedule {name!r}: give exactly one of cron=... or every=...")
    expr = check_cron(cron) if cron is not None else None
    secs = _seconds(every, "every", minimum=MIN_INTERVAL) if every is not None else None
    zone = check_timezone(timezone)
    try:
        policy = Overlap(overlap)
    except ValueError:
        choices = ", ".join(Overlap)
        raise ConfigError(f"overlap: expected one of {choices}, got {overlap!r}") from None
    return ScheduleSpec(
        name=name, workflow=workflow, cron=expr, every=secs, timezone=zone, input=input,
        overlap=policy,
        catchup_window=_seconds(catchup_window, "catchup_window", minimum=MIN_CATCHUP),
        jitter=_seconds(jitter, "jitter") if jitter is not None else 0.0,
        run_deadline=_seconds(run_deadline, "run_deadline") if run_deadline is not None else 0.0,
    )  # fmt: skip


def ticks_after(
    cron: str | None, every: float | None, timezone: str, after: datetime
) -> Iterator[datetime]:
    """The ticks of a cron expression or an interval strictly after `after`, in UTC."""
    if every is not None:
        # Multiples of the interval since the epoch (microseconds, so that no float drifts).
        step = round(every * 1_000_000)
        epoch = datetime(1970, 1, 1, tzinfo=UTC)
        n = (after - epoch) // timedelta(microseconds=step) + 1
        while True:
            yield epoch + timedelta(microseconds=step * n)
            n += 1
    assert cron is not None
    zone = ZoneInfo(timezone)
    local = after.astimezone(zone)
    # cronsim works in wall time from the start of the minute; with fold=1 (the second pass
    # through a repeated hour) the wall time would come round again: begin after it.
    last = after
    for tick in CronSim(cron, local.replace(fold=0)):
        utc = tick.astimezone(UTC)
        if utc > last:  # never the same instant twice, never backwards (a repeated hour)
            last = utc
            yield utc


def jitter_of(name: str, jitter: float, tick: datetime) -> timedelta:
    """How long after `tick` its run starts: the same for every scanner (a hash of the
    schedule and the tick), so all agree when a tick is due."""
    if jitter <= 0:
        return timedelta()
    digest = hashlib.blake2b(f"{name}\x00{tick.isoformat()}".encode(), digest_size=8).digest()
    fraction = int.from_bytes(digest, "big") / 2**64
    return timedelta(seconds=jitter * fraction)


def tick_key(name: str, tick: datetime) -> str:
    """The idempotency key of a tick's run: two scanners starting it start one run."""
    return f"cyclone-schedule:{name}:{tick.astimezone(UTC).isoformat()}"


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """A schedule as stored (client.schedules(), `cyclone schedules`)."""

    name: str
    workflow: str
    cron: str | None
    every: float | None
    timezone: str
    input: Any
    overlap: Overlap
    catchup_window: float
    jitter: float
    run_deadline: float
    paused: bool
    declared: bool
    next_tick_at: datetime
    buffered: tuple[datetime, ...]
    last_tick_at: datetime | None
    last_run_id: str | None
    last_lag: float | None
    started: int
    skipped: int
    missed: int
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Any) -> ScheduleInfo:
        return cls(
            name=row["name"], workflow=row["workflow"], cron=row["cron"], every=row["every"],
            timezone=row["timezone"], input=row["input"], overlap=Overlap(row["overlap"]),
            catchup_window=row["catchup_window"], jitter=row["jitter"],
            run_deadline=row["run_deadline"], paused=row["paused"], declared=row["declared"],
            next_tick_at=row["next_tick_at"], buffered=tuple(row["buffered"]),
            last_tick_at=row["last_tick_at"],
            last_run_id=str(row["last_run_id"]) if row["last_run_id"] else None,
            last_lag=row["last_lag"], started=row["started"], skipped=row["skipped"],
            missed=row["missed"], created_at=row["created_at"], updated_at=row["updated_at"],
        )  # fmt: skip

    @property
    def when(self) -> str:
        """The timing as a person writes it: the cron expression and zone, or `every 300s`."""
        if self.cron is not None:
            return f"{self.cron} ({self.timezone})"
        return f"every {self.every:g}s"

    def next_ticks(self, n: int = 3) -> list[datetime]:
        """The next `n` ticks from next_tick_at on (none while paused)."""
        if self.paused:
            return []
        out = [self.next_tick_at]
        ticks = ticks_after(self.cron, self.every, self.timezone, self.next_tick_at)
        while len(out) < n:
            out.append(next(ticks))
        return out

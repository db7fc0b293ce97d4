"""The ticks a schedule gives (cyclone/schedules.py), without a database: cron names, DST in
Europe/Berlin for fixed and stepped times, intervals on the epoch, jitter that every scanner
computes alike."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import islice

import pytest

from cyclone.errors import ConfigError
from cyclone.schedules import jitter_of, schedule_spec, tick_key, ticks_after


def first(n: int, cron: str | None, every: float | None, zone: str, after: datetime) -> list:
    return list(islice(ticks_after(cron, every, zone, after), n))


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


@pytest.mark.parametrize(
    ("name", "fields"),
    [("@hourly", "0 * * * *"), ("@daily", "0 0 * * *"), ("@midnight", "0 0 * * *"),
     ("@weekly", "0 0 * * 0"), ("@monthly", "0 0 1 * *"), ("@yearly", "0 0 1 1 *"),
     ("@annually", "0 0 1 1 *"), ("@DAILY", "0 0 * * *")],
)  # fmt: skip
def test_cron_names_stand_for_their_five_fields(name: str, fields: str) -> None:
    assert schedule_spec("s", "wf", cron=name).cron == fields


def test_six_fields_are_refused() -> None:
    # cronsim reads a seconds field too; a schedule is 5 fields, as crontab's.
    with pytest.raises(ConfigError, match="5 fields"):
        schedule_spec("s", "wf", cron="0 0 2 * * *")


def test_a_fixed_time_skipped_by_spring_forward_fires_once_at_the_next_valid_instant() -> None:
    got = first(3, "30 2 * * *", None, "Europe/Berlin", utc(2026, 3, 28, 12))
    assert got == [utc(2026, 3, 29, 1, 0), utc(2026, 3, 30, 0, 30), utc(2026, 3, 31, 0, 30)]


def test_a_fixed_time_repeated_by_fall_back_fires_once_at_its_first_occurrence() -> None:
    got = first(2, "30 2 * * *", None, "Europe/Berlin", utc(2026, 10, 24, 12))
    assert got == [utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]


def test_a_stepped_expression_follows_real_time_through_the_repeated_hour() -> None:
    # 02:00 to 03:00 local happens twice: */30 ticks every half hour of real time, never
    # the same instant twice and never backwards.
    got = first(6, "*/30 * * * *", None, "Europe/Berlin", utc(2026, 10, 24, 23, 59))
    assert got == [utc(2026, 10, 25, 0, 0) + timedelta(minutes=30 * n) for n in range(6)]


def test_a_stepped_expression_follows_real_time_through_the_skipped_hour() -> None:
    # 02:00 to 03:00 local does not happen: no tick twice at 03:00 CEST, none lost either.
    got = first(6, "*/30 * * * *", None, "Europe/Berlin", utc(2026, 3, 28, 23, 59))
    assert got == [utc(2026, 3, 29, 0, 0) + timedelta(minutes=30 * n) for n in range(6)]


def test_a_tick_after_an_instant_inside_the_repeated_hour_is_later_than_it() -> None:
    # 02:45 CET, the second pass through 02:45 (fold=1): the next 02:00-hour tick is not
    # 02:30 CEST, an hour earlier.
    after = utc(2026, 10, 25, 1, 45)
    got = first(2, "*/30 * * * *", None, "Europe/Berlin", after)
    assert got == [utc(2026, 10, 25, 2, 0), utc(2026, 10, 25, 2, 30)]


def test_intervals_fall_on_multiples_since_the_epoch() -> None:
    got = first(3, None, 300.0, "UTC", utc(2026, 1, 1, 0, 3, 7))
    assert got == [utc(2026, 1, 1, 0, 5), utc(2026, 1, 1, 0, 10), utc(2026, 1, 1, 0, 15)]
    # Strictly after: an instant on a tick gives the next one.
    assert first(1, None, 300.0, "UTC", utc(2026, 1, 1, 0, 5)) == [utc(2026, 1, 1, 0, 10)]


def test_jitter_is_the_same_for_every_caller_and_within_bounds() -> None:
    tick = utc(2026, 1, 1, 2)
    offsets = {jitter_of("s", 30.0, tick) for _ in range(3)}
    assert len(offsets) == 1 and timedelta() <= offsets.pop() < timedelta(seconds=30)
    assert jitter_of("s", 0.0, tick) == timedelta()
    spread = {jitter_of(f"s{n}", 30.0, tick) for n in range(50)}
    assert len(spread) > 40  # schedules ticking together do not start together


def test_a_ticks_key_names_the_schedule_and_the_instant_in_utc() -> None:
    berlin = datetime(2026, 1, 1, 3, tzinfo=UTC).astimezone()
    assert tick_key("s", berlin) == "cyclone-schedule:s:2026-01-01T03:00:00+00:00"

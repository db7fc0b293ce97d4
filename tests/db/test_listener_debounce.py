"""A flood of NOTIFY on cyclone_revoked costs at most one revocation check per NOTIFY_EVERY,
and no notification is lost (issue 22, item 11: a flood made one supervisor run 7,000 checks
in 4 s)."""

from __future__ import annotations

import select

import psycopg

from cyclone.supervisor.store import NOTIFY_EVERY, Listener
from cyclone.testing import TestEnv


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def flood(dsn: str, count: int) -> None:
    # Distinct payloads: PostgreSQL folds identical notifications of one transaction into one.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_notify('cyclone_revoked', g::text) FROM generate_series(1, %s) g",
            (count,),
        )


def readable(listener: Listener, timeout: float = 5.0) -> bool:
    return bool(select.select([listener.fileno()], [], [], timeout)[0])


def test_a_flood_of_notifications_is_answered_once_per_interval_and_never_lost(env: TestEnv):
    clock = Clock()
    listener = Listener(env.dsn, clock=clock)
    assert listener.open()
    try:
        flood(env.dsn, 5000)
        assert readable(listener)
        checks = sum(listener.drain() for _ in range(50))  # the whole flood read, same instant
        assert checks == 1
        flood(env.dsn, 5000)  # more, within the interval: kept, not answered yet
        assert readable(listener)
        assert sum(listener.drain() for _ in range(50)) == 0
        assert listener.wake_at() == clock.now + NOTIFY_EVERY  # the loop wakes for it
        due_at = clock.now + NOTIFY_EVERY
        clock.now += NOTIFY_EVERY / 2
        assert not listener.due()
        clock.now = due_at
        assert listener.due() and not listener.due()  # answered once, then nothing kept
        assert listener.wake_at() is None
        # Later on, one notification is answered at once.
        clock.now += 10
        flood(env.dsn, 1)
        assert readable(listener) and listener.drain()
    finally:
        listener.close()

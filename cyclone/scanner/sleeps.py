"""Complete sleep nodes whose time is up and advance their runs."""

from __future__ import annotations

from datetime import datetime

from cyclone import engine
from cyclone.scanner.base import Conn, Sweep


class SleepSweep(Sweep):
    name = "sleeps"

    def run_once(self, conn: Conn, now: datetime | None = None) -> int:
        return engine.sweep_sleeps(conn, batch_size=self.batch_size, now=now)

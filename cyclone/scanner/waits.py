"""Dead-letter wait and child nodes parked longer than their `max_wait` (kind `max_wait`).

A child node's child run is cancelled in the same transaction, and the run fails.
"""

from __future__ import annotations

from datetime import datetime

from cyclone import engine
from cyclone.scanner.base import Conn, Sweep


class MaxWaitSweep(Sweep):
    name = "max_wait"

    def run_once(self, conn: Conn, now: datetime | None = None) -> int:
        return engine.sweep_max_wait(conn, batch_size=self.batch_size, now=now)

"""Fail running runs whose deadline has passed.

Every live step of such a run is dead-lettered with kind `deadline` and error `run deadline
exceeded`, waiting child nodes' child runs are cancelled in the same transaction, and the
engine notifies `cyclone_revoked` so that every supervisor kills the handlers at once.
"""

from __future__ import annotations

from datetime import datetime

from cyclone import engine
from cyclone.scanner.base import Conn, Sweep


class DeadlineSweep(Sweep):
    name = "deadlines"

    def run_once(self, conn: Conn, now: datetime | None = None) -> int:
        return engine.sweep_deadlines(conn, batch_size=self.batch_size, now=now)

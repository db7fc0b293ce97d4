"""Forget supervisors that died without withdrawing their presence rows (SIGKILL, host lost).

A live supervisor refreshes its row every few seconds, so one not seen for STALE_AFTER (ten
publish intervals) is gone; its workers' rows go with it by cascade. Its steps are not touched
here: leases held by a lost host come back through lease expiry, as always.
"""

from __future__ import annotations

from datetime import datetime

from cyclone.scanner.base import Conn, Sweep
from cyclone.sql import QUERIES
from cyclone.states import STALE_AFTER


class StalePresenceSweep(Sweep):
    name = "stale_supervisors"
    # Stale rows only matter to a human reading `cyclone status`: no hurry.
    min_interval = STALE_AFTER / 2

    def __init__(self, *, batch_size: int, stale_after: float = STALE_AFTER) -> None:
        super().__init__(batch_size=batch_size)
        self.stale_after = stale_after

    def run_once(self, conn: Conn, now: datetime | None = None) -> int:
        params = {"now": now, "stale_after": self.stale_after, "batch_size": self.batch_size}
        with conn.transaction():
            return len(conn.execute(QUERIES["presence_delete_stale"], params).fetchall())

"""Reclaim leases nobody renewed: the host or worker holding them is gone or stuck.

The step is retried (kind `lease_expired`) while attempts remain, else dead-lettered. Rescue is
keyed on lease expiry only, never on how long a step has been running: a step that is slow but
alive keeps renewing its lease, and taking it away would run it twice at once.
"""

from __future__ import annotations

from datetime import datetime

from cyclone import engine
from cyclone.scanner.base import Conn, Sweep


class ExpiredLeaseSweep(Sweep):
    name = "expired_leases"

    def run_once(self, conn: Conn, now: datetime | None = None) -> int:
        return engine.sweep_expired_leases(conn, batch_size=self.batch_size, now=now)

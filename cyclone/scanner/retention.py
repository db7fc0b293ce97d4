"""Delete finished top-level runs older than the retention, with their child runs and steps."""

from __future__ import annotations

from datetime import datetime

from cyclone import engine
from cyclone.scanner.base import Conn, Sweep

# Old runs pile up slowly, so once a minute is enough however short the scanner interval is.
RETENTION_INTERVAL = 60.0


class RetentionSweep(Sweep):
    name = "retention"
    min_interval = RETENTION_INTERVAL

    def __init__(self, *, batch_size: int, retention: float) -> None:
        super().__init__(batch_size=batch_size)
        self.retention = retention

    def run_once(self, conn: Conn, now: datetime | None = None) -> int:
        return engine.sweep_retention(
            conn, retention=self.retention, batch_size=self.batch_size, now=now
        )

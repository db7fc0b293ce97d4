"""The loop every sweep shares: batches, a pause between them, a log line, a schedule.

The sweeps themselves are entries of `cyclone.engine.sweeps.SWEEPS` (a name and an engine
function that handles one batch in one transaction). A `Sweeper` runs one of them in the
scanner: the loop that batches, jitters and logs lives here once, not in every sweep (River
copies it into each maintenance service). Tests call the engine functions directly, with rows
seeded in a given state and a fixed `now`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import psycopg

from cyclone.engine.sweeps import Sweep

log = logging.getLogger(__name__)

Conn = psycopg.Connection[Any]
# Between two full batches, a short random pause: it lets workers and other scanners at the
# rows, and keeps many scanners from settling into lockstep.
BATCH_PAUSE = (0.05, 0.25)
# A sweep whose batches keep coming back full still yields to the others after this many.
MAX_BATCHES = 20


class Sweeper:
    """One registered sweep as the scanner runs it, safe beside any number of other scanners."""

    def __init__(
        self, sweep: Sweep, *, batch_size: int, settings: Mapping[str, Any] | None = None
    ) -> None:
        self.sweep = sweep
        self.name = sweep.name  # the label of its count on the `scanned` line
        self.batch_size = batch_size
        self.settings = settings
        self.last_run = float("-inf")

    def run_once(self, conn: Conn, now: datetime | None = None) -> int:
        """Handle one batch of due rows; returns how many changed."""
        return self.sweep.batch(conn, batch_size=self.batch_size, now=now, settings=self.settings)

    def due(self, monotonic_now: float) -> bool:
        every = self.sweep.every
        return every is None or monotonic_now - self.last_run >= every

    def run(self, conn: Conn, pause: Callable[[float], None] = time.sleep) -> int:
        """Batches until one comes back short; logs only when something happened."""
        self.last_run = started = time.monotonic()
        budget = self.sweep.budget
        total = 0
        batches = 0
        while True:
            changed = self.run_once(conn)
            total += changed
            batches += 1
            if changed < self.batch_size or batches == self.sweep.batches:
                break
            if budget is not None:
                # Behind: keep going, without pauses (its rows are ended runs, which no worker
                # wants), until the pass's budget is spent; the next pass goes on.
                if time.monotonic() - started >= budget:
                    break
                continue
            if batches >= MAX_BATCHES:
                break
            pause(random.uniform(*BATCH_PAUSE))
        if total and not self.sweep.logs_itself:
            log.info(
                "%s", self.sweep.describe(total), extra={"action": "sweep", "sweep": self.name}
            )
        return total

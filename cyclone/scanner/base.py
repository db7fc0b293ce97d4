"""The shape every sweep shares: one batch per `run_once`, and the loop around it.

A sweep is a small object with a name and `run_once(conn, now) -> int` (rows changed by one
batch, in one transaction). The loop that batches, jitters and logs lives here once, not in
every sweep (River copies it into each maintenance service). Tests call `run_once` directly,
with rows seeded in a given state and a fixed `now`.
"""

from __future__ import annotations

import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar

import psycopg

log = logging.getLogger(__name__)

Conn = psycopg.Connection[Any]
# Between two full batches, a short random pause: it lets workers and other scanners at the
# rows, and keeps many scanners from settling into lockstep.
BATCH_PAUSE = (0.05, 0.25)
# A sweep whose batches keep coming back full still yields to the others after this many.
MAX_BATCHES = 20


class Sweep(ABC):
    """One kind of maintenance, safe to run from any number of scanners at once."""

    name: ClassVar[str]
    # Run at most this often; None: every scanner interval.
    min_interval: ClassVar[float | None] = None

    def __init__(self, *, batch_size: int) -> None:
        self.batch_size = batch_size
        self.last_run = float("-inf")

    @abstractmethod
    def run_once(self, conn: Conn, now: datetime | None = None) -> int:
        """Handle one batch of due rows; returns how many changed."""

    def due(self, monotonic_now: float) -> bool:
        return self.min_interval is None or monotonic_now - self.last_run >= self.min_interval

    def sweep(self, conn: Conn, pause: Callable[[float], None] = time.sleep) -> int:
        """Batches until one comes back short; logs only when something happened."""
        self.last_run = time.monotonic()
        total = 0
        for _ in range(MAX_BATCHES):
            changed = self.run_once(conn)
            total += changed
            if changed < self.batch_size:
                break
            pause(random.uniform(*BATCH_PAUSE))
        if total:
            log.info("%s: %d", self.name, total, extra={"action": "sweep", "sweep": self.name})
        return total

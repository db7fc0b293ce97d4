"""One warning per database outage, not one per retry.

A scanner retrying every 0.5 s during a 5 s outage wrote 26 warnings, which buried the lines
that said what was wrong. `OutageLog` logs the first failure of a streak, a reminder at most
every REMIND_EVERY seconds while it lasts, and one line when the database answers again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

REMIND_EVERY = 30.0


class OutageLog:
    """The log of one caller's database failures (one per process and purpose)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        every: float = REMIND_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.every = every
        self.clock = clock
        self.since: float | None = None
        self.last_logged = 0.0
        self.failures = 0

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.failures += 1
        if self.since is None:
            self.since = self.last_logged = now
            self.logger.warning("%s: database unavailable: %s", self.what, one_line(exc))
        elif now - self.last_logged >= self.every:
            self.last_logged = now
            self.logger.warning(
                "%s: database still unavailable after %.0fs (%d failed attempts): %s",
                self.what, now - self.since, self.failures, one_line(exc),
            )  # fmt: skip

    def succeeded(self) -> bool:
        """Record a success; True when it ended an outage (and that was logged)."""
        if self.since is None:
            return False
        self.logger.info(
            "%s: database answers again after %.1fs (%d failed attempts)",
            self.what, self.clock() - self.since, self.failures,
        )  # fmt: skip
        self.since = None
        self.failures = 0
        return True


def one_line(exc: BaseException) -> str:
    """An error as one line: libpq's messages run over two or three ("connection to server
    ... failed" then the reason), and a log line is one event."""
    return " ".join(str(exc).split()) or type(exc).__name__

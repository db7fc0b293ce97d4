"""The scanner: time-driven maintenance of runs and steps.

The sweeps are declared in `cyclone.engine.sweeps.SWEEPS`, in run order; that module's
docstring says what each does.

    base.py     Sweeper: one sweep's batching loop, pause, log line and schedule
    process.py  the process: a pass of every sweep per `scanner.interval`, reported on its pipe

Each pass runs them in that order, every `scanner.interval` (with jitter), batching while a
batch comes back full, then reports what each changed to the supervisor (`scanned` on its
pipe, counts keyed by the sweeps' names), which turns it into metrics. Every sweep locks its
rows with SKIP LOCKED and re-checks their state before writing, so any number of scanners on
any number of hosts are safe together.
"""

from __future__ import annotations

from cyclone.scanner.process import Scanner, ScannerOptions, make_sweeps

__all__ = ["Scanner", "ScannerOptions", "make_sweeps"]

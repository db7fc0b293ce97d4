"""The scanner: time-driven maintenance of runs and steps, one module per sweep.

    deadlines.py   running run past deadline_at   -> failed; live steps dead (`deadline`);
                                                     leases revoked + NOTIFY cyclone_revoked
    leases.py      running step, lease expired    -> available (retry, `lease_expired`) or dead
    waits.py       waiting step past max_wait      -> dead (`max_wait`); child run cancelled
    sleeps.py      waiting sleep past its wake-up  -> completed; downstream steps available
    retention.py   finished run past retention     -> deleted
    presence.py    supervisor not seen for a while -> its presence rows deleted

Each pass runs them in that order, every `scanner.interval` (with jitter), batching while a
batch comes back full, then reports what each changed to the supervisor (`scanned` on its
pipe), which turns it into metrics. Every sweep locks its rows with SKIP LOCKED and re-checks
their state before writing, so any number of scanners on any number of hosts are safe together.
"""

from __future__ import annotations

from cyclone.scanner.process import Scanner, ScannerOptions, make_sweeps

__all__ = ["Scanner", "ScannerOptions", "make_sweeps"]

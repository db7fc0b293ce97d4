"""`cyclone status`: what every supervisor, worker, run and dead step looks like right now.

Read from the database (supervisors publish themselves and their workers to
cyclone_supervisors / cyclone_workers), so it works from any host that can reach PostgreSQL.
"""

from __future__ import annotations

from cyclone.status.snapshot import LOST_AFTER, SCHEMA_VERSION, Snapshot, take_snapshot

__all__ = ["LOST_AFTER", "SCHEMA_VERSION", "Snapshot", "take_snapshot"]

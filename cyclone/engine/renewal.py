"""Renewing many leases at once: the supervisor vouches for its workers' running steps.

A worker's own thread cannot renew its lease while the handler holds the GIL (one long C call),
so the supervisor renews the leases of the workers it judges alive, all of a pass in one
statement (`steps_renew`), fenced by each lease's token (docs/operators.md, "One step, one
worker").
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg

from cyclone.sql import QUERIES, numbered

Conn = psycopg.Connection[Any]

# steps_renew with $n placeholders: the supervisor sends it through libpq without waiting for
# its answer (supervisor/renewal.py), so that its loop never waits on the database.
RENEW_SQL, RENEW_PARAMS = numbered(QUERIES["steps_renew"])


def renew_params(leases: Sequence[tuple[int, str]], lease_ttl: float) -> dict[str, str | None]:
    """steps_renew's parameters for (step id, lease token) pairs, as text."""
    return {
        "step_ids": "{" + ",".join(str(step_id) for step_id, _ in leases) + "}",
        "tokens": "{" + ",".join(token for _, token in leases) + "}",
        "ttl": repr(float(lease_ttl)),
        "now": None,
    }


def renew_leases(
    conn: Conn,
    leases: Sequence[tuple[int, str]],
    *,
    lease_ttl: float,
    now: datetime | None = None,
) -> set[int]:
    """Renew the leases of (step id, token) pairs; returns the step ids renewed (a lease whose
    token no longer matches, revoked or reclaimed, is not)."""
    if not leases:
        return set()
    rows = conn.execute(
        QUERIES["steps_renew"],
        {
            "step_ids": [step_id for step_id, _ in leases],
            "tokens": [token for _, token in leases],
            "ttl": lease_ttl,
            "now": now,
        },
    ).fetchall()
    return {row["id"] for row in rows}

"""How long a lease is acted on: the same arithmetic on both sides of the pipe.

The worker's keeper stops acting on a lease, and its supervisor kills it, at the same moment:
both compute it here, so they cannot drift apart.
"""

from __future__ import annotations


def lease_trust(lease_ttl: float, heartbeat_interval: float) -> float:
    """How long after its statement was sent a lease is acted on: a heartbeat interval less
    than it lasts in the database. Past that, the worker kills itself and its supervisor
    SIGKILLs it, both before the lease can lapse and be handed to another worker. Config
    validation keeps it at least two heartbeats, so one missed renewal costs nothing."""
    return lease_ttl - heartbeat_interval

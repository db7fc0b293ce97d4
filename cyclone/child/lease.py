"""How long a lease is acted on, and where a worker learns that its supervisor renewed it.

The worker's keeper stops acting on a lease, and its supervisor kills it, at the same moment:
both compute it here, so they cannot drift apart.

The supervisor renews its workers' leases (supervisor/renewal.py) and writes, for each worker,
the step it renewed and when its statement was sent, on a `RenewalBoard`: memory shared with
every worker (an anonymous MAP_SHARED mapping made before any fork). Reading it takes no
message, no lock and no thread switch, and a worker whose handler holds the GIL does not
need to read it at all: only a worker whose supervisor stopped renewing (frozen, or stuck)
must notice, and its keeper thread or SIGCONT handler reads the board when they run.
"""

from __future__ import annotations

import mmap
import struct


def lease_trust(lease_ttl: float, heartbeat_interval: float) -> float:
    """How long after its statement was sent a lease is acted on: a heartbeat interval less
    than it lasts in the database. Past that, the worker kills itself and its supervisor
    SIGKILLs it, both before the lease can lapse and be handed to another worker. Config
    validation keeps it at least two heartbeats, so one missed renewal costs nothing."""
    return lease_ttl - heartbeat_interval


# A slot: the step id renewed (0: none) and when its statement was sent (the host's monotonic
# clock, which supervisor and workers share). Two aligned 8-byte fields: a reader may see the
# one written before the other, which is harmless (see `RenewalBoard.renewed`).
_SLOT = struct.Struct("=qd")
# Slots for one supervisor's children over its life: one per live worker, reused once reaped.
SLOTS = 4096


class RenewalBoard:
    """One slot per live worker: the supervisor writes, the worker reads."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.mem = mmap.mmap(-1, slots * _SLOT.size)  # anonymous: MAP_SHARED, kept across fork
        self.free = list(range(slots - 1, -1, -1))

    def take(self) -> int | None:
        """A slot for a worker about to be forked (None: all taken)."""
        if not self.free:
            return None
        slot = self.free.pop()
        _SLOT.pack_into(self.mem, slot * _SLOT.size, 0, 0.0)
        return slot

    def give_back(self, slot: int | None) -> None:
        if slot is not None:
            self.free.append(slot)

    def write(self, slot: int, step_id: int, sent: float) -> None:
        # The step first, then the time: the order `renewed` relies on.
        struct.pack_into("=q", self.mem, slot * _SLOT.size, step_id)
        struct.pack_into("=d", self.mem, slot * _SLOT.size + 8, sent)

    def renewed(self, slot: int | None, step_id: int) -> float | None:
        """When the supervisor last sent a renewal of `step_id`'s lease; None: never.

        The step id is written first: a read between the two writes sees the new step with the
        previous step's time, which is older than the new lease's own start and so extends
        nothing; the old step with the new time does not match `step_id`."""
        if slot is None:
            return None
        written, sent = _SLOT.unpack_from(self.mem, slot * _SLOT.size)
        return sent if written == step_id else None

"""The worker process: one step at a time, every write fenced by its lease.

Forked by the supervisor, it opens its own connection, joins its own process group and dies
with its parent. It runs the handler in its main thread; its supervisor renews the lease
meanwhile (one statement for all its workers), and a keeper thread (keeper.py) relays a stop
to `ctx.done` and ends the process if the renewals stop coming:

                       nothing due: sleep poll_interval
                         +-------+
                         v       |
    boot --ready--> [ idle ] ----+
                       |  ^
                 lease |  | done: record the outcome fenced, tell the supervisor
                       v  |
                    [ busy ] --the supervisor renews every heartbeat_interval
                       |
                       +--lease not renewed in time---------------> exit LEASE_LOST
                       +--revoked: the supervisor kills it
                       +--SIGTERM: ctx.done set, handler returns--> exit STOPPED (no write)
                       +--supervisor gone-------------------------> exit ORPHANED

    SIGUSR1 (drain, resize, reload): finish the current step, then exit OK.
    max_steps_per_worker steps done: exit RECYCLE, and the supervisor forks a fresh one.

A worker never kills itself for a timeout, a cancel or a deadline: the supervisor does, with
SIGTERM then SIGKILL of the whole group, and writes the outcome once the process is dead.
"""

from __future__ import annotations

from cyclone.worker.loop import Worker, WorkerOptions

__all__ = ["Worker", "WorkerOptions"]

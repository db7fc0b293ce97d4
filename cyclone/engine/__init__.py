"""The engine: every state change of runs and steps, as functions taking a connection.

Workers, the scanner, the supervisor, the client and the test harness all call these same
functions; only the process orchestration around them differs. Each takes an optional `now`
(None means the database clock) so tests can move time without sleeping.

steps.py     a worker's side of a step: lease, heartbeat, complete, fail, release, fenced
advance.py   how a run moves: a node completes, its downstream nodes get steps, a run fails
runs.py      a run's own operations: submit, lock, cancel a tree of runs (advance.py uses it)
control.py   operations on whole runs from outside: cancel, pause, resume, signal
dlq.py       re-driving a dead step and its failed run
graphs.py    workflow graphs in the database
register.py  registering workflows: graphs, patches and declared schedules in one transaction
versions.py  which graph versions a process's code can run: what it may lease
patches.py   ctx.patched(): a change's answer, recorded once per run
dispatch.py  the supervisor's statement for its workers: finished tasks and leases for many
renewal.py   the supervisor's renewal of its workers' leases, many in one statement
schedules.py schedules: upsert, pause, resume, trigger, backfill, and their sweep
sweeps.py    the scanner's sweeps: SWEEPS, one entry each in run order, and their functions
"""

from __future__ import annotations

from cyclone.engine.control import cancel_run, pause_run, resume_run, signal_run
from cyclone.engine.graphs import current_graph, graph_by_hash
from cyclone.engine.patches import patched
from cyclone.engine.register import register_workflows
from cyclone.engine.runs import submit_runs
from cyclone.engine.schedules import (
    backfill_schedule,
    delete_schedule,
    get_schedule,
    list_schedules,
    pause_schedule,
    resume_schedule,
    save_schedule,
    sweep_schedules,
    trigger_schedule,
    upsert_schedule,
)
from cyclone.engine.steps import (
    FINISHED,
    Lease,
    complete_and_lease,
    complete_step,
    expand_map,
    fail_step,
    heartbeat,
    lease_step,
    release_step,
    revoked_leases,
    start_child,
)
from cyclone.engine.sweeps import (
    SWEEPS,
    Sweep,
    enabled_sweeps,
    sweep_deadlines,
    sweep_expired_leases,
    sweep_fair_clock,
    sweep_held_steps,
    sweep_history,
    sweep_history_drop,
    sweep_max_wait,
    sweep_queued_deadlines,
    sweep_reindex,
    sweep_retention,
    sweep_sleeps,
    sweep_stale_supervisors,
    sweep_unserved,
)

__all__ = [
    "FINISHED",
    "SWEEPS",
    "Lease",
    "Sweep",
    "backfill_schedule",
    "cancel_run",
    "complete_and_lease",
    "complete_step",
    "current_graph",
    "delete_schedule",
    "enabled_sweeps",
    "expand_map",
    "fail_step",
    "get_schedule",
    "graph_by_hash",
    "heartbeat",
    "lease_step",
    "list_schedules",
    "patched",
    "pause_run",
    "pause_schedule",
    "register_workflows",
    "release_step",
    "resume_run",
    "resume_schedule",
    "revoked_leases",
    "save_schedule",
    "signal_run",
    "start_child",
    "submit_runs",
    "sweep_deadlines",
    "sweep_expired_leases",
    "sweep_fair_clock",
    "sweep_held_steps",
    "sweep_history",
    "sweep_history_drop",
    "sweep_max_wait",
    "sweep_queued_deadlines",
    "sweep_reindex",
    "sweep_retention",
    "sweep_schedules",
    "sweep_sleeps",
    "sweep_stale_supervisors",
    "sweep_unserved",
    "trigger_schedule",
    "upsert_schedule",
]

"""The supervisor's log of step outcomes: one INFO line per step a worker finished or was killed in.

    step demo-order/reserve run=1f2e3d4c-... attempt=1 completed in 3ms
    step demo-flaky/call_partner run=87743ee1-... attempt=1 failed (error, will retry) after 9ms
    step demo-stuck/hang run=394dcae7-... attempt=1 killed after 5.0s (deadline): the run failed

(whole run ids, shortened here), each record with the step's fields for the JSON logs.

Workers report outcomes over their pipes, so this costs the supervisor one log record per step
and the workers nothing; at thousands of steps a second, set [logging] level = "warning".
"""

from __future__ import annotations

import logging
from typing import Any

from cyclone.child import channel
from cyclone.logs import step_fields
from cyclone.supervisor.children import HeldLease, KillReason

log = logging.getLogger("cyclone.supervisor.arbiter")

# What a revocation kill says about the run, for the log line.
RUN_ENDED = {
    KillReason.DEADLINE: ": the run failed, run deadline exceeded",
    KillReason.CANCEL: ": the run was cancelled or failed elsewhere",
}


def step_label(lease: HeldLease) -> str:
    """`step demo-order/reserve run=<whole id> attempt=1`: greppable by run, and the id is one
    `cyclone run` takes (a short one it rejects)."""
    node = lease.node if lease.item is None else f"{lease.node}[{lease.item}]"
    return f"step {lease.workflow}/{node} run={lease.run_id} attempt={lease.attempt}"


def step_extra(lease: HeldLease, action: str) -> dict[str, Any]:
    """A log record's extra about a lease: its action and the step's fields (cyclone/logs.py)."""
    extra = {"action": action, **step_fields(lease, lease.item)}
    if lease.trace_id is not None:
        extra["trace_id"] = lease.trace_id
    return extra


def format_elapsed(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.1f}s"


def log_outcome(lease: HeldLease, done: channel.Done) -> None:
    """One INFO line per step outcome a worker reports: what the demo shows scrolling by."""
    if not log.isEnabledFor(logging.INFO):
        return  # a busy supervisor logging at WARNING should not format lines it drops
    took = format_elapsed(done.duration)
    if done.outcome == "expanded":
        extra = step_extra(lease, "step")
        log.info("%s made its items in %s", step_label(lease), took, extra=extra)
    elif done.outcome == "completed":
        log.info("%s completed in %s", step_label(lease), took, extra=step_extra(lease, "step"))
    elif done.outcome == "failed":
        then = "will retry" if done.retry else "dead-lettered"
        log.info(
            "%s failed (error, %s) after %s: %s", step_label(lease), then, took, done.error,
            extra=step_extra(lease, "step"),
        )  # fmt: skip
    else:
        log.info(
            "%s finished after %s but its lease was gone: result discarded", step_label(lease),
            took, extra=step_extra(lease, "step"),
        )  # fmt: skip

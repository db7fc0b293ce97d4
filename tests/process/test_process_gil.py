"""A handler that holds the GIL in one long C call is busy, not dead (issue 29).

Its worker's own threads cannot run meanwhile, so nothing inside the worker can vouch for it:
the supervisor renews the leases of the workers the OS says are alive and not stopped. These
handlers (proc_gil_flows.py) check that the GIL really was held (a thread of theirs did not
run during the call). A hung handler is still killed, by its step's timeout and not earlier.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from proc_helpers import LEASES, TTL, terminal, wait_for

from cyclone.states import ErrorKind, RunState

pytestmark = pytest.mark.process

MODULES = '["proc_flows", "proc_gil_flows"]'


def test_a_handler_holding_the_gil_for_three_leases_completes_under_short_leases(
    env, supervisor
) -> None:
    from proc_gil_flows import gil

    sup = supervisor(workers=1, workflows__modules=MODULES, **LEASES)
    run_id = env.client.submit(gil, {"seconds": int(3 * TTL)})
    status = wait_for(lambda: terminal(env, run_id), 30, "the run to end")
    assert status.state == RunState.COMPLETED, (status.error, sup.log())
    held = status.output["hold"]
    assert held["took"] >= 3 * TTL - 0.1
    assert held["ticks_during"] <= 1, "the GIL was not held: the test proves nothing"
    (step,) = env.client.steps(run_id)
    assert step.attempt == 1
    assert "killing worker" not in sup.log()


def test_a_cpu_bound_c_call_holding_the_gil_past_a_lease_completes(env, supervisor) -> None:
    """sum(range(n)), as the issue found it, sized here to outlast a whole lease."""
    from proc_gil_flows import crunch

    # Calibrated on this host now (best of three), aiming at 5 leases: the worker's own call
    # has run at half the calibrated time (CI, a busy neighbour then a quiet one), and the
    # test needs only that it outlast one lease with a margin.
    rate = max(10**7 / _timed(lambda: sum(range(10**7))) for _ in range(3))
    sup = supervisor(workers=1, workflows__modules=MODULES, **LEASES)
    run_id = env.client.submit(crunch, {"n": int(rate * 5 * TTL)})
    status = wait_for(lambda: terminal(env, run_id), 90, "the run to end")
    assert status.state == RunState.COMPLETED, (status.error, sup.log())
    held = status.output["add_up"]
    assert held["took"] > 1.5 * TTL and held["ticks_during"] <= 1, held
    assert "killing worker" not in sup.log()


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def test_a_handler_holding_the_gil_past_a_default_lease_completes(env, supervisor) -> None:
    """With the default lease (30 s, renewed every 5 s), where a call over 25 s was killed.

    40 s outlasts both that old limit and one whole lease; the short-lease test above holds
    for three leases, so three default ones (90 s of the suite) prove nothing more.
    """
    from proc_gil_flows import gil

    sup = supervisor(
        workers=1, workflows__modules=MODULES,
        worker__lease_ttl='"30s"', worker__heartbeat_interval='"5s"',
    )  # fmt: skip
    run_id = env.client.submit(gil, {"seconds": 40})
    status = wait_for(lambda: terminal(env, run_id), 100, "the run to end", interval=0.5)
    assert status.state == RunState.COMPLETED, (status.error, sup.log())
    held = status.output["hold"]
    assert held["took"] >= 39.9 and held["ticks_during"] <= 1
    assert "killing worker" not in sup.log()


def test_a_hung_handler_holding_the_gil_is_killed_by_its_timeout_and_not_earlier(
    env, supervisor
) -> None:
    from proc_gil_flows import hang

    sup = supervisor(workers=1, workflows__modules=MODULES, **LEASES)
    run_id = env.client.submit(hang, {})
    status = wait_for(lambda: terminal(env, run_id), 30, "the run to end")
    (step,) = env.client.steps(run_id)
    assert (status.state, step.error_kind) == (RunState.FAILED, ErrorKind.TIMEOUT), sup.log()
    # Killed for its timeout (6 s, three leases) and for nothing else before it.
    kills = re.findall(r"killing worker \d \(pid \d+\) step \d+ \S+: (\w+)", sup.log())
    assert kills == ["timeout"]
    assert step.completed_at - step.started_at >= timedelta(seconds=6)

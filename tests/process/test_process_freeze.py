"""One step, one worker at a time, even when a busy worker is frozen (SIGSTOP) past its lease.

The handlers here ignore ctx.done and write a ledger line every 20 ms (proc_flows.tick), so
each attempt's interval is on record, on the host's monotonic clock; no two attempts of one
step may overlap, whatever froze.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from ledger import overlaps, read_ledger
from proc_helpers import LEASES, TTL, alive, completed, wait_for

pytestmark = pytest.mark.process


def busy_workers(tmp: Path, workers: list[int], within: float = 0.1) -> list[int]:
    """Workers that wrote a ledger line in the last `within` seconds."""
    path = tmp / "ledger.log"
    if not path.exists():
        return []
    now, recent = time.monotonic(), set()
    for line in path.read_text().splitlines()[-200:]:
        _, _, pid, at = line.split()
        if now - float(at) < within:
            recent.add(int(pid))
    return [pid for pid in workers if pid in recent]


def test_workers_frozen_past_their_lease_never_overlap_the_attempt_that_replaced_them(
    env, supervisor, tmp_path
) -> None:
    """Three runs in flight on five workers: a step taken from a frozen worker is picked up by
    an idle one at once, as on a lightly loaded host (with a long queue, the reclaimed step
    waits its turn and the frozen worker is long dead when it comes)."""
    from proc_flows import ledger

    sup = supervisor(workers=5, **LEASES)
    rng = random.Random(12)
    run_ids: list[str] = []
    frozen: list[tuple[int, float]] = []
    timers: list[threading.Timer] = []
    deadline = time.monotonic() + 25
    while len(frozen) < 10 and time.monotonic() < deadline:
        timers = [t for t in timers if t.is_alive()]
        if in_flight(env, run_ids) < 3:
            run_ids.append(env.client.submit(ledger, {"dir": str(tmp_path), "seconds": 1.5}))
        held = {pid for pid, _ in frozen[-2:]} if timers else set()
        targets = [p for p in busy_workers(tmp_path, sup.workers()) if p not in held]
        if len(timers) >= 2 or not targets:
            time.sleep(0.05)
            continue
        pause = TTL + rng.uniform(0.1, 2.0)
        os.kill(targets[0], signal.SIGSTOP)
        frozen.append((targets[0], pause))
        timers.append(threading.Timer(pause, _resume, (targets[0],)))
        timers[-1].start()
    for timer in timers:
        timer.join()
    assert len(frozen) >= 8, f"only {len(frozen)} freezes in 25 s"
    wait_for(lambda: all(completed(env, r) for r in run_ids), 60, "every run to complete")
    steps = read_ledger(tmp_path)
    assert overlaps(steps) == []
    # The freezes cost attempts: a frozen worker was killed and its step ran again.
    assert sum(len(attempts) - 1 for attempts in steps.values()) >= len(frozen) // 2
    # Frozen workers were killed as frozen (the OS said stopped, so the supervisor did not renew
    # their leases, and SIGKILLed them before the leases could lapse), or for their reclaimed
    # lease when the supervisor itself was held up (a loaded machine).
    kills = re.findall(r"killing worker \d \(pid \d+\) step \d+ .*: (frozen|lease_expired)",
                       sup.log())  # fmt: skip
    assert len(kills) >= len(frozen) // 2 and kills.count("frozen") >= len(kills) // 2


def in_flight(env, run_ids: list[str]) -> int:
    if not run_ids:
        return 0
    row = env.conn.execute(
        "SELECT count(*) AS n FROM cyclone_runs WHERE id = ANY(%s::uuid[]) AND state = 'running'",
        (run_ids,),
    ).fetchone()
    return row["n"]


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_a_worker_resumed_past_its_lease_under_a_frozen_supervisor_runs_no_more_handler_code(
    env, supervisor, tmp_path
) -> None:
    from proc_flows import ledger

    sup = supervisor(workers=1, **LEASES)
    run_id = env.client.submit(ledger, {"dir": str(tmp_path), "seconds": 6.0})
    worker = wait_for(lambda: busy_workers(tmp_path, sup.workers()), 10, "the step to start")[0]
    # As if the whole host froze: the supervisor cannot kill, the worker cannot renew.
    os.kill(sup.pid, signal.SIGSTOP)
    os.kill(worker, signal.SIGSTOP)
    try:
        # Another host's supervisor (its scanner) reclaims the lapsed lease, and its worker
        # takes the step over.
        supervisor(workers=1, **LEASES)
        wait_for(lambda: 2 in next(iter(read_ledger(tmp_path).values())), 10, "attempt 2")
        resumed_at = time.monotonic()
        os.kill(worker, signal.SIGCONT)
        wait_for(lambda: not alive(worker), 5, "the resumed worker to exit")
    finally:
        _resume(worker)
        os.kill(sup.pid, signal.SIGCONT)
    (step,) = read_ledger(tmp_path).values()
    assert step[1][1] < resumed_at, "the resumed worker ran its handler again"
    # Its SIGCONT handler (main thread) or its lease keeper (which wakes on the same signal)
    # ended it, whichever ran first.
    assert re.search(r"resumed past its lease|step \d+: lease not renewed in time", sup.log())
    wait_for(lambda: completed(env, run_id), 20, "the run to complete")
    assert overlaps(read_ledger(tmp_path)) == []


def test_a_worker_whose_supervisor_is_frozen_ends_itself_before_its_lease_lapses(
    env, supervisor, tmp_path
) -> None:
    """Its supervisor renews its lease: frozen, it renews nothing, and the worker's keeper,
    which finds no renewal in the memory they share, ends the worker (exit 4) before the
    lease can lapse and another host's worker take the step."""
    from proc_flows import ledger

    sup = supervisor(workers=1, **LEASES)
    run_id = env.client.submit(ledger, {"dir": str(tmp_path), "seconds": 6.0})
    worker = wait_for(lambda: busy_workers(tmp_path, sup.workers()), 10, "the step to start")[0]
    os.kill(sup.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        wait_for(lambda: not alive(worker), 10, "the worker to end itself")
        # Within the lease's trust (lease_ttl - heartbeat_interval) of its last renewal.
        assert time.monotonic() - frozen_at < TTL + 0.5
        supervisor(workers=1, **LEASES)  # another host's: it takes the step once reclaimed
        wait_for(lambda: 2 in next(iter(read_ledger(tmp_path).values())), 15, "attempt 2")
    finally:
        os.kill(sup.pid, signal.SIGCONT)
    wait_for(lambda: completed(env, run_id), 20, "the run to complete")
    assert overlaps(read_ledger(tmp_path)) == []
    assert re.search(r"step \d+: lease not renewed in time", sup.log())

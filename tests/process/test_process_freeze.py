"""One step, one worker at a time, even when a busy worker is frozen (SIGSTOP) past its lease.

The handlers here ignore ctx.done and write a ledger line every 20 ms (proc_flows.tick), so
each attempt's interval is on record, on the host's monotonic clock; no two attempts of one
step may overlap, whatever froze.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from proc_helpers import alive, completed, wait_for

pytestmark = pytest.mark.process

# Short leases so that a freeze outlives one quickly: the lease is acted on for 1.5 s after
# each renewal (lease_ttl - heartbeat_interval), and the scanner reclaims within 0.1 s of a
# lapse. A long kill_grace, as the chaos soak that found the overlap had: no kill of a worker
# whose lease may lapse may wait for it (with a silent kill at lease_ttl after SIGTERM and a
# grace, as before, this test saw overlaps).
LEASES = {
    "worker__lease_ttl": '"2s"', "worker__heartbeat_interval": '"500ms"',
    "scanner__interval": '"100ms"', "supervisor__kill_grace": '"1s"',
}  # fmt: skip
TTL = 2.0


def read_ledger(tmp: Path) -> dict[int, dict[int, tuple[float, float, int]]]:
    """step -> attempt -> (first line, last line, pid)."""
    steps: dict[int, dict[int, tuple[float, float, int]]] = {}
    path = tmp / "ledger.log"
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        step, attempt, pid, at = line.split()
        attempts = steps.setdefault(int(step), {})
        first, last, _ = attempts.get(int(attempt), (float(at), float(at), int(pid)))
        attempts[int(attempt)] = (min(first, float(at)), max(last, float(at)), int(pid))
    return steps


def overlaps(steps: dict[int, dict[int, tuple[float, float, int]]]) -> list[str]:
    found = []
    for step, attempts in steps.items():
        spans = sorted(attempts.items(), key=lambda kv: kv[1][0])
        for (a, (_, a_end, a_pid)), (b, (b_start, _, b_pid)) in itertools.pairwise(spans):
            if b_start <= a_end:
                found.append(
                    f"step {step}: attempt {b} (pid {b_pid}) started at {b_start:.3f}, before "
                    f"attempt {a} (pid {a_pid}) wrote its last line at {a_end:.3f}"
                )
    return found


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
    # Frozen workers were killed as silent (SIGKILL at once, before their leases lapsed), or
    # for their reclaimed lease when the supervisor itself was held up (a loaded machine).
    kills = re.findall(r"killing worker \d \(pid \d+\) step \d+ .*: (silent|lease_expired)",
                       sup.log())  # fmt: skip
    assert len(kills) >= len(frozen) // 2 and kills.count("silent") >= len(kills) // 2


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

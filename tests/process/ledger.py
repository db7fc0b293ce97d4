"""The attempt ledger: each attempt's interval on the host's monotonic clock, and the check
that no two attempts of one step overlap.

Handlers that ignore ctx.done append `step attempt pid monotonic-time` to DIR/ledger.log
every 20 ms (tests/process/proc_flows.py's `tick`, bench/chaos.py's `_work`). Two attempts of
a step overlap when one started before the other wrote its last line: two workers ran the
step at once. The freeze tests and the chaos bench (which imports this file) check it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

LEDGER = "ledger.log"

Ledger = dict[int, dict[int, tuple[float, float, int]]]


def _lines(folder: Path) -> Iterator[tuple[int, int, int, float]]:
    """(step, attempt, pid, time) of each whole line of folder/ledger.log."""
    path = Path(folder) / LEDGER
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 4:
            continue  # a line cut by a SIGKILL mid-write
        yield int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])


def read_ledger(folder: Path) -> Ledger:
    """step -> attempt -> (first line, last line, pid), from folder/ledger.log."""
    steps: Ledger = {}
    for step, attempt, pid, at in _lines(folder):
        attempts = steps.setdefault(step, {})
        first, last, _ = attempts.get(attempt, (at, at, pid))
        attempts[attempt] = (min(first, at), max(last, at), pid)
    return steps


def read_starts(folder: Path) -> dict[tuple[int, int, int], float]:
    """(step, attempt, pid) -> its first line. A step given back with its attempt not spent
    starts again under the same attempt number, which read_ledger's spans merge into one: in
    another worker it is another start, which a rate limit must count."""
    first: dict[tuple[int, int, int], float] = {}
    for step, attempt, pid, at in _lines(folder):
        key = (step, attempt, pid)
        first[key] = min(first.get(key, at), at)
    return first


def overlaps(steps: Ledger) -> list[str]:
    """One line for each attempt that started before the attempt before it ended."""
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

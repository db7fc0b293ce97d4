"""Buffers each hot statement touches under a backlog, by statistics state. Prints a table.

    python bench/plans.py [--backlog 20000]

The same cases as tests/db/test_plans.py, printed instead of asserted: a burst submitted through
the public API on tables never analyzed, analyzed while empty, analyzed with a history of
finished runs and an empty queue, and analyzed after the burst. Each statement is explained
as a prepared statement runs it (custom and generic plan; the larger figure is shown), in a
transaction rolled back afterwards. Buffers are deterministic for a given schema and fill, so
two revisions can be compared on a busy machine: run it at each (PYTHONPATH=<checkout>).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # plan_probe.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "db"))

import test_plans
from plan_probe import probe

from cyclone.testing import server_dsn


class _Request:
    def __init__(self, param: str) -> None:
        self.param = param


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backlog", type=int, default=test_plans.BACKLOG, help="one-step runs")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    test_plans.BACKLOG = args.backlog
    base = server_dsn()
    table: dict[str, dict[str, str]] = {}
    for state in test_plans.STATES:
        fixture = test_plans.backlog.__wrapped__(_Request(state), base)  # type: ignore[attr-defined]
        b = next(fixture)
        try:
            for name, params in test_plans.STATEMENTS.items():
                modes = ["custom"] if name in test_plans.UNPREPARED else ["custom", "generic"]
                try:
                    worst = max(probe(b.env.conn, name, params(b), m).buffers for m in modes)
                    table.setdefault(name, {})[state] = f"{worst:,}"
                except Exception as exc:  # an older revision may lack a statement
                    table.setdefault(name, {})[state] = type(exc).__name__
        finally:
            next(fixture, None)
    print(f"Buffers touched, worst of custom and generic plans; {args.backlog:,} one-step runs"
          " available plus 5,200 runs of other shapes\n")  # fmt: skip
    width = max(len(n) for n in table)
    print(f"{'statement':<{width}}" + "".join(f"{s:>18}" for s in test_plans.STATES))
    for name, row in table.items():
        print(f"{name:<{width}}" + "".join(f"{row.get(s, '-'):>18}" for s in test_plans.STATES))
    return 0


if __name__ == "__main__":
    sys.exit(main())

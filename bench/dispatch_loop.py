"""The supervisor's statement alone, in one session: what a statement costs the server.

    python bench/dispatch_loop.py [--statement steps_dispatch|steps_dispatch_plain]
                                  [--flow none] [--batch 8] [--reps 2] [--runs 5000]

`--runs` 1-step runs of runtime.py's FLOWS[--flow] are submitted through the API (every
runtime.py workflow registered, limits among them); then the statement, prepared and sent
through libpq with $n placeholders as the supervisor sends it, completes the steps the
previous one leased and leases `--batch` more, until none is left. Prints the median time a
statement takes, on this host's clock, for each rep. With PYTHONPATH set to an older tree
(a worktree), the same loop times that tree's statement: the figures before and after a change
to the hot path (bench/README.md, "Migration 34").
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import runtime
from psycopg import pq

from cyclone.engine.dispatch import Dispatched, Finished, dispatch_params, floor_params
from cyclone.engine.steps import _LeaseFloor
from cyclone.sql import QUERIES, numbered
from cyclone.testing import TestEnv, server_dsn


def finished(row: dict[str, Any]) -> Finished:
    """The completion a worker sends for a lease row (its slot, where this tree has one)."""
    told = {"slot": row.get("slot")} if "slot" in Finished.__dataclass_fields__ else {}
    return Finished(row["id"], row["lease_token"], row["run_id"], None, last=True, **told)


def drain(env: TestEnv, sql: str, names: list[str], batch: int) -> list[float]:
    """Seconds each statement took, until two in a row leased nothing."""
    workflows = [w.name for w in runtime.FLOWS.values()]
    pg, floor = env.conn.pgconn, _LeaseFloor()
    done: list[Finished] = []
    times: list[float] = []
    empty = 0
    while empty < 2:
        params = dispatch_params(
            done, [f"w{i}" for i in range(batch)], workflows=workflows, lease_ttl=30.0
        )
        params.update(floor_params(floor))
        values = [None if params[k] is None else str(params[k]).encode() for k in names]
        start = time.perf_counter()
        result = pg.exec_prepared(b"loop", values)
        times.append(time.perf_counter() - start)
        if result.status != pq.ExecStatus.TUPLES_OK:
            raise RuntimeError((result.error_message or b"").decode())
        found = Dispatched.parse(result.get_value(0, 0).decode())
        floor.taken(found.last())
        done = [finished(row) for row in found.leases.values()]
        empty = 0 if found.leases else empty + 1
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--statement", default="steps_dispatch")
    p.add_argument("--flow", default="none", choices=sorted(runtime.FLOWS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--runs", type=int, default=5000)
    args = p.parse_args()
    sql, names = numbered(QUERIES[args.statement])
    with TestEnv(dsn=server_dsn(), workflows=list(runtime.FLOWS.values())) as env:
        env.client.set_rate_limit("bench-unbound", rate=1e9, per=1.0, burst=1e9)
        env.conn.commit()
        env.conn.autocommit = True
        prepared = env.conn.pgconn.prepare(b"loop", sql.encode())
        if prepared.status != pq.ExecStatus.COMMAND_OK:
            raise RuntimeError((prepared.error_message or b"").decode())
        for rep in range(args.reps):
            wf = runtime.FLOWS[args.flow]
            for start in range(0, args.runs, 1000):
                n = min(1000, args.runs - start)
                env.client.submit_many(wf, [{"k": (start + j) % 100} for j in range(n)])
            times = drain(env, sql, names, args.batch)
            print(f"{args.statement} {args.flow} rep {rep + 1}: {len(times)} statements,"
                  f" median {statistics.median(times) * 1e6:.0f} µs a statement of"
                  f" {args.batch}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

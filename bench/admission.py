"""One admission of held steps (cyclone_admit_steps), timed alone. Prints figures.

    python bench/admission.py [--steps 30] [--calls 40] [--dsn DSN]

Each call admits the `--steps` held steps of a rate-limited node, in a transaction rolled back
after it, so every call finds the same rows; the median of `--calls` calls (a node's
`concurrency` holds no step since migration 33: its steps wait for a slot available):

* read / unread, pending=N: a node with an unbound rate limit, its bucket promising a
  token to N steps still waiting to start. `read`: the bucket was last read a second ago, so
  the admission reads its pending list and writes it back (every admission did, before
  migration 32); `unread`: it was read just now, so the admission leaves the list alone and
  keeps the steps it gives tokens to in `fresh` (docs/flow-control.md).

A busy bucket's list holds the steps leased in the last 0.3 s: about 1,500 at 5,000 steps a
second.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import cyclone
from cyclone.db import connect
from cyclone.testing import TestEnv, server_dsn

PENDING = (0, 600, 1500)


def _noop(ctx: cyclone.StepContext) -> None:
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="held steps each call admits")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--dsn", help="server to use (default: the embedded test server)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    rated = cyclone.Workflow("adm-rated")
    rated.task(_noop, name="s1", rate_limit="adm-unbound")
    waiting = cyclone.Workflow("adm-waiting")  # the pending steps: available, never leased
    waiting.task(_noop, name="s1")
    with TestEnv(dsn=args.dsn or server_dsn()) as env:
        env.register(rated, waiting)
        env.client.set_rate_limit("adm-unbound", rate=1e9, per=1.0, burst=1e9)
        conn = env.conn
        env.client.submit_many(rated, [None] * args.steps)
        # Held again, as steps short of a token are (no trigger: nothing admits).
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            conn.execute(
                "UPDATE cyclone_steps SET state = 'waiting', held = true"
                " WHERE workflow = %s AND state = 'available'",
                (rated.name,),
            )
        env.client.submit_many(waiting, [None] * max(PENDING))
        ids = [
            r["id"] for r in conn.execute(
                "SELECT id FROM cyclone_steps WHERE workflow = %s ORDER BY id", (waiting.name,)
            ).fetchall()
        ]  # fmt: skip
        conn.execute("VACUUM ANALYZE cyclone_steps")
        cases = [
            (f"{mode} pending={n}", rated, n, age)
            for n in PENDING for mode, age in (("read", "1 second"), ("unread", "0"))
        ]  # fmt: skip
        with connect(env.dsn) as c:
            print(f"One admission of {args.steps} held steps, median of {args.calls} calls")
            for label, wf, pending, age in cases:
                times, admitted = [], 0
                for _ in range(args.calls):
                    with c.transaction(force_rollback=True):
                        if pending is not None:
                            c.execute(
                                "UPDATE cyclone_rate_buckets SET pending = %s, fresh = '{}',"
                                " tokens = 1e9, updated_at = now() - %s::interval",
                                (ids[:pending], age),
                            )
                        start = time.perf_counter()
                        admitted = c.execute(
                            "SELECT cyclone_admit_steps(%s, 's1', now()) AS n", (wf.name,),
                        ).fetchone()["n"]
                        times.append(time.perf_counter() - start)
                median = statistics.median(times)
                print(f"  {label:20} {median * 1e3:6.3f} ms, {median * 1e6 / max(admitted, 1):5.1f}"
                      f" µs a step ({admitted} admitted)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

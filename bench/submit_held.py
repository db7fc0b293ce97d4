"""What a submit of held steps costs: submit_many into a rate-limited node, with the
insert trigger of migration 28 (one admission per node and statement) beside the one before it
(an admission for every row), in one run.

    python bench/submit_held.py                      # 5 reps of 10 x submit_many(1,000)
    python bench/submit_held.py --reps 3 --batch 500 --batches 20

Each rep makes a fresh schema, submits `--batches` batches of `--batch` runs of a 1-step
workflow whose node's bucket holds 64 tokens and refills one an hour (so the first 64 are
admitted and the rest held), through
the public API, and times the submits (this host's clock); then the same with the previous
trigger function put back in that schema. The two alternate which goes first. It prints runs
a second submitted and the ratio; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import cyclone
from cyclone.testing import TestEnv, server_dsn

limited = cyclone.Workflow("bench-submit-held")


@limited.task(rate_limit="bench-submit-held")
def step(ctx: cyclone.StepContext) -> None:
    return None


# cyclone_steps_admit as migration 25 left it: every held row calls the admission.
PER_ROW = """
CREATE OR REPLACE FUNCTION cyclone_steps_admit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    admitted integer;
BEGIN
    admitted := cyclone_admit_steps(NEW.workflow, NEW.node, now());
    RETURN NULL;
END
$$;
"""


def submit_rate(dsn: str, per_row: bool, batch: int, batches: int) -> float:
    with TestEnv(workflows=[limited], dsn=dsn) as env:
        env.client.set_rate_limit("bench-submit-held", rate=1, per=3600.0, burst=64)
        if per_row:
            env.conn.execute(PER_ROW)
        with cyclone.Client(env.dsn) as client:
            client.submit_many(limited, [None])  # connections and plans made before timing
            started = time.perf_counter()
            for _ in range(batches):
                client.submit_many(limited, [None] * batch)
            elapsed = time.perf_counter() - started
        held = env.conn.execute(
            "SELECT count(*) AS n FROM cyclone_steps WHERE held AND workflow = %s",
            (limited.name,),
        ).fetchone()["n"]
        assert held == batch * batches + 1 - 64, held
    return batch * batches / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    dsn = args.dsn or server_dsn()
    once, every = [], []
    for rep in range(args.reps):
        order = [False, True] if rep % 2 == 0 else [True, False]
        got = {per_row: submit_rate(dsn, per_row, args.batch, args.batches) for per_row in order}
        once.append(got[False])
        every.append(got[True])
        print(f"  rep {rep + 1}/{args.reps}: once per statement {got[False]:,.0f} runs/s,"
              f" every row {got[True]:,.0f} runs/s, ratio {got[False] / got[True]:.2f}",
              flush=True)  # fmt: skip
    ratios = [a / b for a, b in zip(once, every, strict=True)]
    print(f"\nsubmit_many({args.batch:,}) into a node limited to 64, medians of {args.reps}:")
    print(f"  once per statement (migration 28): {statistics.median(once):>8,.0f} runs/s")
    print(f"  every row (before):                {statistics.median(every):>8,.0f} runs/s")
    print(f"  ratio {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()

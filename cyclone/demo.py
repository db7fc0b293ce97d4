"""Demo workflows, and `python -m cyclone.demo`: submit a few runs, then start the supervisor.

What you should see within about ten seconds: orders completing (tasks, a fan-out, a signal
that arrived early, a sleep and a child run), a flaky step retried until it succeeds, and a
handler that ignores cancellation hard-killed when its run's deadline passes.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import cyclone

shipping = cyclone.Workflow("demo-ship")


@shipping.task(timeout=timedelta(seconds=10))
def label(ctx: cyclone.StepContext) -> dict:
    return {"label": f"PKG-{ctx.input['order']}"}


orders = cyclone.Workflow("demo-order")


@orders.task(timeout=timedelta(seconds=10))
def reserve(ctx: cyclone.StepContext) -> dict:
    return {"order": ctx.input["order"], "items": ctx.input["items"]}


@orders.map(after=[reserve], items=lambda ctx: ctx.results["reserve"]["items"])
def pick(ctx: cyclone.StepContext) -> str:
    return f"picked {ctx.item}"


orders.wait("approval", signal="approved", after=[pick], max_wait=timedelta(minutes=5))
orders.sleep("cool-off", timedelta(seconds=2), after=["approval"])
orders.child(
    "ship",
    shipping,
    after=["cool-off"],
    input=lambda ctx: ctx.results["reserve"],
    max_wait=timedelta(minutes=1),
)

flaky = cyclone.Workflow("demo-flaky")


@flaky.task(max_attempts=4, timeout=timedelta(seconds=10))
def call_partner(ctx: cyclone.StepContext) -> str:
    if ctx.attempt < 3:
        raise ConnectionError(f"partner API unavailable (attempt {ctx.attempt})")
    return f"answered on attempt {ctx.attempt}"


stuck = cyclone.Workflow("demo-stuck")


@stuck.task(timeout=timedelta(minutes=5), max_attempts=1)
def hang(ctx: cyclone.StepContext) -> None:
    # Ignores ctx.done on purpose: the supervisor kills it when the run's deadline passes.
    while True:
        time.sleep(1)


def submit_demo_runs(client: cyclone.Client) -> list[str]:
    ids = []
    for n in range(3):
        run_id = client.submit(
            orders, {"order": n, "items": ["a", "b", "c"]}, run_deadline=timedelta(minutes=2)
        )
        client.signal(run_id, "approved", {"by": "demo"})  # kept until the wait is reached
        ids.append(run_id)
    ids.append(client.submit(flaky, {}, run_deadline=timedelta(minutes=2)))
    ids.append(client.submit(stuck, {}, run_deadline=timedelta(seconds=5)))
    return ids


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config = argv[0] if argv else "config/demo.toml"
    from cyclone.config import load_config

    settings = load_config(config)
    cyclone.migrate(settings.database.url)
    with cyclone.Client(settings.database.url) as client:
        for run_id in submit_demo_runs(client):
            print(f"submitted run {run_id}", file=sys.stderr)
    print(f"starting: cyclone-supervisor --config {config}", file=sys.stderr)
    os.execvp(sys.executable, [sys.executable, "-m", "cyclone.supervisor", "--config", config])


if __name__ == "__main__":
    main()

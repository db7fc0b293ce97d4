"""Demo workflows, and `python -m cyclone.demo`: submit a few runs, then run the supervisor.

What you should see within about ten seconds: orders completing (tasks, a fan-out, a signal
that arrived early, a sleep and a child run), a flaky step retried until it succeeds, and a
handler that ignores cancellation hard-killed when its run's deadline passes. The demo says
how to watch it (`cyclone status` in another terminal) and how to stop it (Ctrl-C) when it
starts, and again once every demo run has ended; the supervisor runs until stopped.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

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


ORDERS = 3  # demo-order runs submitted


def submit_demo_runs(client: cyclone.Client) -> list[str]:
    ids = []
    for n in range(ORDERS):
        run_id = client.submit(
            orders, {"order": n, "items": ["a", "b", "c"]}, run_deadline=timedelta(minutes=2)
        )
        client.signal(run_id, "approved", {"by": "demo"})  # kept until the wait is reached
        ids.append(run_id)
    ids.append(client.submit(flaky, {}, run_deadline=timedelta(minutes=2)))
    ids.append(client.submit(stuck, {}, run_deadline=timedelta(seconds=5)))
    return ids


# Each line fits 80 columns: this is read in a terminal, between log lines.
NEXT_STEPS = """\
  watch it:  cyclone status (in another terminal; also cyclone runs, dlq list)
  stop it:   Ctrl-C (the supervisor drains; the runs stay in the database)
  and then:  cyclone embedded stop (PostgreSQL keeps running until then)"""
# How often the showcase's runs are checked, and how long it may take before we stop looking.
POLL = 0.5
SHOWCASE_TIMEOUT = 120.0


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def find_config(argv: list[str]) -> str:
    """The config given, else config/demo.toml here, else the one in this checkout."""
    if argv:
        return argv[0]
    for candidate in (Path("config/demo.toml"), Path(__file__).parents[1] / "config/demo.toml"):
        if candidate.is_file():
            return str(candidate)
    raise SystemExit(
        "cyclone.demo: no config/demo.toml here or in the Cyclone checkout: "
        "python -m cyclone.demo PATH/TO/demo.toml"
    )


def main(argv: list[str] | None = None) -> int:
    """Submit the demo runs, run the supervisor until Ctrl-C, and say what to do meanwhile."""
    from cyclone.config import load_config
    from cyclone.db import resolve_dsn
    from cyclone.errors import CycloneError

    config = find_config(sys.argv[1:] if argv is None else argv)
    try:
        settings = load_config(config)
        dsn = resolve_dsn(settings.database.url, settings.database.embedded_dir)
        cyclone.migrate(dsn)
        with cyclone.Client(dsn) as client:
            ids = submit_demo_runs(client)
    except CycloneError as exc:
        say(f"cyclone.demo: {exc}")
        return 2
    # `cyclone runs` lists the child runs the orders start too: say so, or the counts differ.
    children = sum(1 for n in orders.graph.nodes.values() if n.kind == cyclone.NodeKind.CHILD)
    say(
        f"submitted {len(ids)} demo runs (the orders start {children * ORDERS} child runs more: "
        f"cyclone runs lists {len(ids) + children * ORDERS}); starting cyclone-supervisor "
        f"--config {config}"
    )
    say(NEXT_STEPS)
    supervisor = subprocess.Popen([sys.executable, "-m", "cyclone.supervisor", "--config", config])
    # Ctrl-C reaches the supervisor too (one process group): it drains, and we wait for it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.send_signal(signal.SIGTERM))
    summary = wait_for_showcase(dsn, ids, supervisor)
    if summary is not None:
        say(f"the demo runs have ended ({summary}); the supervisor keeps running:")
        say(NEXT_STEPS)
    return supervisor.wait()


def wait_for_showcase(dsn: str, ids: list[str], supervisor: subprocess.Popen[bytes]) -> str | None:
    """Once every demo run has ended, how they ended; None if the supervisor ended first."""
    deadline = time.monotonic() + SHOWCASE_TIMEOUT
    with cyclone.Client(dsn) as client:
        while supervisor.poll() is None and time.monotonic() < deadline:
            try:
                states = [client.get_run(run_id).state for run_id in ids]
            except Exception:  # the database restarting: the supervisor reports it
                states = []
            if states and all(state.terminal for state in states):
                counts = Counter(state.value for state in states)
                return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
            time.sleep(POLL)
    return None


if __name__ == "__main__":
    sys.exit(main())

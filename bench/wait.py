"""Wake-up latency of `wait`: from the commit that ends a run to the waiter's `wait` returning.

    python bench/wait.py                      # 1 and 1,000 waiters, LISTEN/NOTIFY and polling
    python bench/wait.py --waiters 1,1000,5000 --rounds 200 --modes notify
    python bench/wait.py --dsn postgresql://...

One asyncio process holds the waiters: an AsyncClient each of them awaits `wait` on, so they
share its one watcher connection. Runs of a one-node workflow (a wait for a signal) are
submitted, every waiter is registered and the watcher is listening (or, with `poll`, polling:
`listen=False`, as behind PgBouncer in transaction mode), then a thread ends the runs one at a
time through the engine (`signal_run`: the wait completes, the run completes, one transaction
each), as fast as it can, on a connection of its own. It notes the time after each COMMIT
returned; each waiter notes the time its `wait` returned. Both clocks are this host's
monotonic clock. With 1 waiter the round is repeated `--rounds` times.

The figures include the event loop's own delays: 1,000 waiters woken at once wake in turn.
On a shared machine read p50 more than p99. Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import cyclone
from cyclone import engine
from cyclone.clients import waiting
from cyclone.db import connect
from cyclone.testing import TestEnv, server_dsn

held = cyclone.Workflow("bench-wait")
held.wait("go", signal="go")


def end_runs(dsn: str, run_ids: list[str], ended: dict[str, float], go: threading.Event) -> None:
    """End each run in a transaction of its own, noting when its COMMIT returned."""
    with connect(dsn, "bench-wait-ender") as conn:
        go.wait()
        for run_id in run_ids:
            engine.signal_run(conn, run_id, "go")
            ended[run_id] = time.monotonic()


async def round_of(client: cyclone.AsyncClient, dsn: str, count: int) -> list[float]:
    """Latencies (seconds) of `count` waiters whose runs end one after another."""
    run_ids = await client.submit_many(held, [{}] * count)
    returned: dict[str, float] = {}

    async def wait(run_id: str) -> None:
        await client.wait(run_id, timeout=120)
        returned[run_id] = time.monotonic()

    tasks = [asyncio.ensure_future(wait(r)) for r in run_ids]
    while not (w := client._watcher) or len(w.watch._waiting) < count or w._conn is None:
        await asyncio.sleep(0.005)
    ended: dict[str, float] = {}
    go = threading.Event()
    ender = threading.Thread(target=end_runs, args=(dsn, run_ids, ended, go))
    ender.start()
    go.set()
    await asyncio.gather(*tasks)
    await asyncio.to_thread(ender.join)
    return [returned[r] - ended[r] for r in run_ids]


async def measure(dsn: str, count: int, rounds: int, listen: bool) -> list[float]:
    async with cyclone.AsyncClient(dsn, listen=listen) as client:
        await round_of(client, dsn, 1)  # the watcher connects (and probes) once, untimed
        latencies: list[float] = []
        for _ in range(rounds):
            latencies += await round_of(client, dsn, count)
        if listen:
            assert client._watcher.watch.heard, "notifications did not arrive"
        return latencies


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", default="1,1000", help="comma-separated waiter counts")
    parser.add_argument("--rounds", type=int, default=100, help="rounds of 1 waiter")
    parser.add_argument("--modes", default="notify,poll", help="notify, poll or both")
    parser.add_argument("--dsn", help="a server (default: the embedded test server)")
    args = parser.parse_args()
    print(f"polling interval without notifications: {waiting.POLL_UNHEARD}s")
    print(f"{'mode':<7} {'waiters':>7} {'samples':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    with TestEnv([held], dsn=args.dsn or server_dsn()) as env:
        for mode in args.modes.split(","):
            for count in (int(n) for n in args.waiters.split(",")):
                rounds = args.rounds if count == 1 else 1
                lat = asyncio.run(measure(env.dsn, count, rounds, listen=mode == "notify"))
                print(
                    f"{mode:<7} {count:>7} {len(lat):>7} {pct(lat, 50) * 1e3:>8.2f}"
                    f" {pct(lat, 99) * 1e3:>8.2f} {max(lat) * 1e3:>8.2f}",
                    flush=True,
                )
                assert statistics.fmean(lat) > 0


if __name__ == "__main__":
    main()

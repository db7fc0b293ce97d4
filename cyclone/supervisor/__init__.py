"""The supervisor: forks workers and a scanner on one host, and kills what outlives its bounds.

__main__.py    `cyclone-supervisor --config FILE`: validate, connect, migrate, register
supervisor.py  the loop: one thread, one selector, signal handlers that only record (/metrics aside)
arbiter.py     the decisions: spawn, kill (SIGTERM, then SIGKILL of the group), record, drain
children.py    the records: WorkerHandle, HeldLease, KillOrder, ExitStatus
processes.py   ProcessOps: fork, signal, killpg, waitpid, /proc state (OsProcessOps, the real one)
store.py       the kept connection for its few writes; the LISTEN connection for revocations
dispatch.py    leasing for the waiting workers and recording their finished tasks, in batches
renewal.py     the session renewing the busy workers' leases, one statement a pass (see arbiter)
outcomes.py    one log line per step outcome
metrics.py     the Prometheus registry, fed by the children's pipes, served by threads of its own
gauges.py      the gauges read from the database at scrape time (DLQ depth, active runs)
presence.py    the supervisor's and its workers' rows, for `cyclone status` on any host
labels.py      workflow and node label values of the metrics, capped (the rest: "other")

The pipe protocol, process titles and a child's set-up live in cyclone.child, which the
workers and the scanner import too.
"""

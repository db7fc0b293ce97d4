"""Process titles, so `ps` shows what every Cyclone process is doing.

cyclone supervisor
cyclone worker 3: fulfill-order/reserve run=<id> attempt=2
cyclone worker 3: idle
cyclone scanner
"""

from __future__ import annotations

import sys

try:
    import setproctitle as _spt
except ImportError:  # pragma: no cover - setproctitle is a dependency, but titles are optional
    _spt = None

# setproctitle moves the environment on its first call and getproctitle() triggers that set-up;
# do it once at import, before any fork, as gunicorn learned (#3430). On macOS it can crash
# forked children, so titles are Linux-only there (gunicorn #3021).
_ENABLED = _spt is not None and sys.platform != "darwin"
if _ENABLED:
    _spt.getproctitle()


def worker_name(host: str, supervisor_pid: int, number: int, pid: int) -> str:
    """Who holds a lease (cyclone_steps.leased_by): `vm-1:4310 worker 2 pid 4315`. The
    supervisor's host:pid first, as `cyclone workers` names it, then which of its workers: a
    bare `host:pid` read as a supervisor's, and was a worker's."""
    return f"{host}:{supervisor_pid} worker {number} pid {pid}"


def set_title(title: str) -> None:
    if _ENABLED:
        _spt.setproctitle(title)


def supervisor_title() -> str:
    return "cyclone supervisor"


def scanner_title() -> str:
    return "cyclone scanner"


def worker_title(
    number: int,
    *,
    workflow: str | None = None,
    node: str | None = None,
    run_id: str | None = None,
    attempt: int | None = None,
) -> str:
    if workflow is None:
        return f"cyclone worker {number}: idle"
    return f"cyclone worker {number}: {workflow}/{node} run={run_id} attempt={attempt}"

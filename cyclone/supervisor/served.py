"""Which workflows this supervisor's workers serve, what a reload can change, and a warning for
runs that no live supervisor serves.

Workers lease only steps of the workflows their registry holds. A SIGHUP re-reads the config
and imports modules newly listed in [workflows] modules, but a module already imported keeps
its code (Python caches it, and the workers are forked from this process): a workflow added to
such a module stays unknown until a restart, and its runs wait with workers idle. So the
supervisor says so at start and after every reload, `cyclone status` shows it, and
`cyclone_runs_unserved{workflow}` exports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from cyclone.config import Settings
from cyclone.sql import QUERIES
from cyclone.workflow import Registry

log = logging.getLogger("cyclone.supervisor")

# The same threshold after which `cyclone status` calls a supervisor lost.
LOST_AFTER = 10.0
# A warning names at most this many workflows.
MAX_NAMED = 10


def serving(loaded: Registry, settings: Settings) -> Registry:
    """The workflows this VM's workers lease for: those of the queues it serves ([supervisor]
    queues; unset: every queue). Runs of the others are left to the VMs that serve them, and
    reported when none does."""
    return loaded.only(lambda wf: settings.supervisor.serves(wf.queue))


def leasing_alone(served: Registry, settings: Settings) -> tuple[str, ...]:
    """What a worker leases when it leases on its own (told to by a failing dispatcher): the
    workflows of uncapped queues only, since only the supervisor can keep a queue's cap."""
    caps = settings.supervisor.caps()
    return tuple(name for name, wf in served.items() if wf.queue not in caps)


RELOAD_APPLIES = (
    "reload applies: [supervisor] workers, kill_grace, shutdown_timeout, max_steps_per_worker; "
    "[worker] and [scanner] settings; modules newly listed in [workflows] modules "
    "(children are replaced)"
)
RELOAD_KEEPS = (
    "reload cannot change (restart for these): code of modules already imported, so a workflow "
    "added to one is not served; [database]; [metrics]; [logging]"
)


def describe_reload(old: Settings, new: Settings) -> list[str]:
    """Warnings for changed settings a reload leaves as they were."""
    ignored = [
        name
        for name in ("database", "metrics", "logging")
        if getattr(old, name) != getattr(new, name)
    ]
    return [f"[{name}] changed: it takes effect only on restart" for name in ignored]


def unserved_runs(
    conn: psycopg.Connection[Any],
    served: Iterable[str],
    self_id: str | None,
    graphs: Iterable[str] | None = None,
) -> list[dict[str, Any]]:
    """Running runs by workflow and graph version that neither this supervisor (`served`
    workflows, of them `graphs`: None, all) nor another live supervisor serves."""
    params = {
        "served": sorted(served), "self_id": self_id, "lost_after": LOST_AFTER,
        "limit": MAX_NAMED, "graphs": None if graphs is None else sorted(graphs),
    }  # fmt: skip
    return [dict(r) for r in conn.execute(QUERIES["status_unserved"], params).fetchall()]


def warn_unserved(
    connect: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
    served: Iterable[str],
    self_id: str | None,
    graphs: Iterable[str] | None = None,
    told: set[tuple[str, str]] | None = None,
) -> list[dict[str, Any]]:
    """Log a warning naming the workflows (and graph versions) whose running runs no worker
    serves; returns them. With `told`, the versions already named there are not named again
    (it is updated: a version served again leaves it, to be named if it recurs)."""
    try:
        with connect() as conn:
            found = unserved_runs(conn, served, self_id, graphs)
    except psycopg.Error as exc:
        log.warning("cannot check for runs no worker serves: %s", exc)
        return []
    if told is not None:
        now = {(r["workflow"], r["graph_hash"]) for r in found}
        found = [r for r in found if (r["workflow"], r["graph_hash"]) not in told]
        told.intersection_update(now)
        told.update(now)
    if found:
        named = ", ".join(
            f"{r['workflow']} version {r['graph_hash'][:12]} ({r['runs']} runs)" for r in found
        )
        log.warning(
            "running runs no worker serves wait with workers idle: %s; deploy code that has "
            "their nodes (`cyclone workflows` lists the versions), or list their module in "
            "[workflows] modules and restart if it is already listed (a reload does not "
            "re-import a module)", named, extra={"action": "unserved"},
        )  # fmt: skip
    return found

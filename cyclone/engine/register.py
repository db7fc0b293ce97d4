"""Registering workflows: their graphs, made current by name, the changes their handlers name
(ctx.patched), and the schedules they declare.

Above graphs.py and schedules.py, which it joins in one transaction (schedules.py reads graphs
through graphs.py: this is not in graphs.py, so that imports run one way).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg

from cyclone.engine.graphs import registration
from cyclone.engine.patches import register_patches
from cyclone.engine.schedules import upsert_declared
from cyclone.sql import QUERIES
from cyclone.workflow import Workflow


def register_workflows(
    conn: psycopg.Connection[Any], workflows: Iterable[Workflow], *, now: datetime | None = None
) -> None:
    """Store each workflow's graph (and its child workflows') and make it current by name;
    upsert the schedules they declare (and log those no longer declared), all at once. `now`
    places a new schedule's first tick (None: the database clock)."""
    workflows = list(workflows)
    with conn.transaction():
        for params in registration(workflows):
            conn.execute(QUERIES["graph_register"], params)
            conn.execute(QUERIES["workflow_register"], params)
        register_patches(conn, workflows, now=now)
        upsert_declared(conn, workflows, now=now)

"""`cyclone.testing`: run workflows in-process against a real PostgreSQL, without waiting.

`TestEnv` gives each test its own schema (so envs never see each other's runs), registers its
workflows as a supervisor would, and runs due steps with the very engine functions the worker
and scanner processes use. Its clock is the database clock shifted by `advance_time`: time
gates (retries, sleeps, max_wait, run deadlines) are crossed without sleeping.

`env.client` and `env.async_client()` are a Client and an AsyncClient on the env. Their `wait`
and `result` first run the run to its end in-process, as `run_until_complete` does, so code
that submits and then awaits a result works under test with no worker and no waiting.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from cyclone import engine, runner, testing_schemas
from cyclone.clients.aclient import AsyncClient
from cyclone.clients.client import Client
from cyclone.context import Effects
from cyclone.db import connect
from cyclone.embedded import ensure_test_server
from cyclone.engine.versions import served_graphs
from cyclone.errors import RunStuck
from cyclone.migrate import migrate
from cyclone.models import RunStatus
from cyclone.schedules import jitter_of
from cyclone.sql import QUERIES
from cyclone.states import RunState
from cyclone.workflow import Registry, Workflow

_TEST_WORKER = "testenv"
_LEASE_TTL = 60.0
# advance_time stops at most this often (a minute schedule over a week: 10,080 stops).
_MAX_TICK_STOPS = 100_000


# What server_dsn() returned, once it has: read without calling it (which would start a server).
_server_dsn_found: list[str] = []


@functools.cache
def server_dsn() -> str:
    """CYCLONE_TEST_DSN, else this install's embedded test server (checked and started once
    per process, then reused; see `cyclone.embedded.ensure_test_server`)."""
    dsn = os.environ.get("CYCLONE_TEST_DSN") or ensure_test_server()
    _server_dsn_found.append(dsn)
    return dsn


class TestEnv:
    """An isolated Cyclone on a real PostgreSQL, driven step by step from the test."""

    __test__ = False  # not a test class, whatever pytest thinks of the name

    def __init__(self, workflows: Iterable[Workflow] = (), dsn: str | None = None) -> None:
        base = dsn or server_dsn()
        self._keeper = testing_schemas.keeper_for(base, next(iter(_server_dsn_found), None))
        made = self._keeper.take() if self._keeper is not None else None
        self.schema = made or testing_schemas.new_name()
        if made is None:
            with psycopg.connect(base, autocommit=True) as admin:
                admin.execute(sql.SQL(QUERIES["schema_create"]).format(sql.Identifier(self.schema)))
        self._base = base
        self.dsn = make_conninfo(base, options=f"-c search_path={self.schema}")
        self._effects_conn: psycopg.Connection[Any] | None = None
        try:
            self.conn = connect(self.dsn)
            if made is None:
                migrate(self.conn)  # a schema made ahead was made as migrate makes a new one
            self.registry = Registry()
            self._offset = timedelta()
            # The monotonic start is read before the server's clock, so the env's clock is
            # never behind the server's: a step the server made available at its now() is
            # due at the env's now() read after it (read after the query, it lagged by the
            # round trip, and a lease right after a release found nothing now and then).
            self._mono_start = time.monotonic()
            self._db_start: datetime = self.conn.execute(QUERIES["clock_now"]).fetchone()["now"]
            self.client = Client(
                self.dsn, _clock=self.now, _on_workflow=self.register, _on_wait=self._finish
            )
            self.register(*workflows)
        except BaseException:
            # No half-made env: its connections and schema must not outlive the failure (an
            # unclosed connection's ResourceWarning would fail some unrelated test later).
            for part in (getattr(self, "client", None), getattr(self, "conn", None)):
                if part is not None:
                    part.close()
            with contextlib.suppress(psycopg.Error):
                self._drop_schema()
            raise

    def async_client(self, **kwargs: Any) -> AsyncClient:
        """An AsyncClient on this env, like `env.client`; open it in the test's event loop
        (`async with env.async_client() as client:`) and close it there."""
        return AsyncClient(
            self.dsn, _clock=self.now, _on_workflow=self.register, _on_wait=self._finish, **kwargs
        )

    # -- setup ---

    def register(self, *workflows: Workflow) -> None:
        """Load these workflows' code and register their graphs, as a supervisor does."""
        for wf in workflows:
            if wf.name not in self.registry:
                self.registry.add(wf)
        if workflows:
            engine.register_workflows(self.conn, workflows, now=self.now())

    def close(self) -> None:
        self.client.close()
        self.conn.close()
        if self._effects_conn is not None:
            self._effects_conn.close()
        # Every session of the env is closed: the schema can go while the next test runs.
        if self._keeper is None or not self._keeper.drop(self.schema):
            self._drop_schema()

    def _drop_schema(self) -> None:
        with psycopg.connect(self._base, autocommit=True) as admin:
            admin.execute(sql.SQL(QUERIES["schema_drop"]).format(sql.Identifier(self.schema)))

    def __enter__(self) -> TestEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the clock ---

    def now(self) -> datetime:
        """The env's database clock: the server's time, moved forward by advance_time."""
        return (
            self._db_start + timedelta(seconds=time.monotonic() - self._mono_start) + self._offset
        )

    def advance_time(self, delta: timedelta | float) -> None:
        """Move the clock forward. Schedule ticks passed over fire on the way: the clock
        stops at each one (in order, whichever schedule it is), the scanner's sweeps run and
        then every due step, as workers would have, so "three nightly runs after three
        days" holds, with each run's fate seen by the next tick's overlap policy."""
        if not isinstance(delta, timedelta):
            delta = timedelta(seconds=delta)
        if delta < timedelta():
            raise ValueError("time only moves forward")
        target = self.now() + delta
        for _ in range(_MAX_TICK_STOPS):
            due = self._next_tick_due()
            if due is None or due > target:
                break
            if due > self.now():
                self._offset += due - self.now()
            self.run_until_idle()
        else:
            raise RunStuck(f"more than {_MAX_TICK_STOPS} schedule ticks in one advance_time")
        if target > self.now():
            self._offset += target - self.now()

    def _next_tick_due(self) -> datetime | None:
        """When the earliest next tick of an unpaused schedule is due (its jitter included)."""
        return min(
            (s.next_tick_at + jitter_of(s.name, s.jitter, s.next_tick_at)
             for s in engine.list_schedules(self.conn) if not s.paused),
            default=None,
        )  # fmt: skip

    # -- running ---

    def run_one(self) -> bool:
        """Lease, run and record one due step; False when none is due."""
        lease = engine.lease_step(
            self.conn,
            worker=_TEST_WORKER,
            workflows=list(self.registry),
            lease_ttl=_LEASE_TTL,
            now=self.now(),
            # As a supervisor leases: only steps of graph versions this code can run.
            graphs=served_graphs(self.conn, self.registry),
        )
        if lease is None:
            return False
        effects = Effects(self._effects_session, lease.step_id, lease.token)
        outcome = runner.execute(self.conn, self.registry, lease, effects=effects)
        if runner.record_effects(effects, lease, outcome, now=self.now()) is None:
            runner.record(self.conn, lease, outcome, now=self.now())
        return True

    def _effects_session(self) -> psycopg.Connection[Any]:
        """The second session ctx.transaction() writes through, as a worker has."""
        if self._effects_conn is None or self._effects_conn.closed:
            self._effects_conn = connect(self.dsn, "cyclone-effects")
            self._effects_conn.autocommit = False
        return self._effects_conn

    def scan(self) -> int:
        """One batch of every sweep the scanner runs, in its order (`engine.enabled_sweeps`:
        no retention here); returns how many rows changed."""
        return sum(sweep.batch(self.conn, now=self.now()) for sweep in engine.enabled_sweeps())

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        """Run every due step and sweep until nothing is due now; returns the steps run."""
        ran = 0
        while ran < max_steps:
            if self.run_one():
                ran += 1
            elif not self.scan():
                return ran
        raise RunStuck(f"still busy after {max_steps} steps: is a workflow looping?")

    def run_until_complete(self, run_id: str, max_steps: int = 10_000) -> RunStatus:
        """Run (moving the clock to the next time gate when nothing is due) until the run ends."""
        for _ in range(max_steps):
            self.run_until_idle(max_steps)
            status = self.client.get_run(run_id)
            if status.state.terminal:
                return status
            if status.state == RunState.PAUSED:
                raise RunStuck(f"run {run_id} is paused: resume it to let it finish")
            gate = self.conn.execute(QUERIES["next_time_gate"]).fetchone()["at"]
            if gate is None:
                raise RunStuck(self._stuck_reason(run_id))
            if gate > self.now():
                self._offset += gate - self.now() + timedelta(microseconds=1)
            elif not self.run_until_idle(max_steps):
                raise RunStuck(self._stuck_reason(run_id))
        raise RunStuck(f"run {run_id} did not finish within {max_steps} rounds")

    def _finish(self, run_id: str) -> None:
        """Before a client's wait: the run is run to its end (RunStuck if it cannot end)."""
        self.run_until_complete(run_id)

    def _stuck_reason(self, run_id: str) -> str:
        waits = [s for s in self.client.steps(run_id) if s.state == "waiting"]
        if waits:
            names = ", ".join(f"{s.node!r}" for s in waits)
            return f"run {run_id} can only wait: for a signal or child run at {names}"
        return f"run {run_id} has nothing due and nothing to wait for (is its code registered?)"

    def steps(self, run_id: str) -> list[Any]:
        return self.client.steps(run_id)


def _env() -> Iterator[TestEnv]:
    """A fresh, isolated TestEnv per test; register workflows with `cyclone_env.register(wf)`."""
    with TestEnv() as env:
        yield env


# The fixture needs pytest; the harness does not (`pip install cyclone` has no pytest, and a
# script or another test runner may use TestEnv alone).
try:
    import pytest
except ImportError:
    pass
else:
    cyclone_env = pytest.fixture(name="cyclone_env")(_env)

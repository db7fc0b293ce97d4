"""TestEnv's schemas made ahead and dropped behind, by a thread of the test process.

Making an env's schema (schema.sql run in it, ~45 ms) and dropping it (~30 ms) were on the path
of every test that uses a TestEnv; a suite has about 1,400 of them. The work is the server's:
while a test runs, a thread of the same process makes the next env's schema, and drops the
schemas of envs closed before, on a connection of its own.

Opt-in (`schemas_in_background()`, as tests/conftest.py does), for the session's test server
only: a script or a benchmark keeps making and dropping its schema in its own path, with no
thread working beside what it measures. `settle()` (at exit at the latest) drops what is still
queued and the schema made ahead, and names what it could not drop: no schema outlives the
process that made it, unless the process is killed.
"""

from __future__ import annotations

import atexit
import sys
import threading
import uuid
from collections import deque

import psycopg
from psycopg import sql

from cyclone.migrate import install
from cyclone.sql import QUERIES, current_schema, migrations

# Drops queued at most: past it a closing env drops its schema itself, so that tests faster
# than the drops do not pile up schemas (and catalog rows) for the thread to catch up with.
MAX_QUEUED_DROPS = 8
# The keeper's session in pg_stat_activity.
APPLICATION_NAME = "cyclone-test-schemas"
# How long settle() waits for the thread to drop what is queued.
SETTLE_TIMEOUT = 120.0


def new_name() -> str:
    return f"cyclone_test_{uuid.uuid4().hex[:12]}"


class SchemaKeeper:
    """One thread and one connection to the `base` server: one schema made ahead at a time,
    and the drops of closed envs' schemas, in that order of urgency."""

    def __init__(self, base: str) -> None:
        self.base = base
        # Read now, once: the thread never reads them again, so a test that patches
        # cyclone.migrate's `migrations` (to migrate a schema to an older version) cannot
        # change a schema made meanwhile for another test.
        self._script = current_schema()
        self._versions = [(version, name) for version, name, _ in migrations()]
        self._cond = threading.Condition()
        self._spare: str | None = None
        self._wanted = False
        self._drops: deque[str] = deque()
        self._stopping = False
        self._failures: list[str] = []
        self._current: str | None = None  # the schema being made or dropped
        self._thread = threading.Thread(target=self._run, name="cyclone-test-schemas", daemon=True)
        self._thread.start()

    def take(self) -> str | None:
        """A schema made ahead, if one is ready (None: make it yourself); the next is then
        made while this one is in use."""
        with self._cond:
            name, self._spare = self._spare, None
            self._wanted = not self._stopping
            self._cond.notify_all()
            return name

    def drop(self, name: str) -> bool:
        """Queue a closed env's schema to be dropped; False (drop it yourself) when too many
        are queued or the keeper is settling."""
        with self._cond:
            if self._stopping or len(self._drops) >= MAX_QUEUED_DROPS:
                return False
            self._drops.append(name)
            self._cond.notify_all()
            return True

    def settle(self, timeout: float = SETTLE_TIMEOUT) -> list[str]:
        """Drop what is queued and the schema made ahead, and stop; the failures, if any
        (a schema that could not be dropped is named in one)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            failures = list(self._failures)
            if self._thread.is_alive():
                left = [n for n in (self._current, *self._drops, self._spare) if n is not None]
                failures.append(
                    f"schemas still being dropped after {timeout:g}s (does a session hold a"
                    f" lock on them?): {', '.join(left)}"
                )
            return failures

    def _next_job(self) -> tuple[str, str | None] | None:
        """("make", None), ("drop", name), or None: stop. Waits for one."""
        with self._cond:
            while True:
                if self._stopping:
                    if self._spare is not None:
                        self._drops.append(self._spare)
                        self._spare = None
                    return ("drop", self._drops.popleft()) if self._drops else None
                if self._wanted and self._spare is None:
                    self._wanted = False
                    return ("make", None)
                if self._drops:
                    return ("drop", self._drops.popleft())
                self._cond.wait()

    def _run(self) -> None:
        conn: psycopg.Connection | None = None
        while (job := self._next_job()) is not None:
            kind, name = job
            with self._cond:
                self._current = name
            # A drop is tried again once on a new connection: a test may have ended this
            # one's session (or restarted nothing but a backend).
            for tries_left in (1, 0) if kind == "drop" else (0,):
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(
                            self.base, autocommit=True, application_name=APPLICATION_NAME
                        )
                    if kind == "make":
                        self._make(conn)
                    else:
                        assert name is not None
                        _drop(conn, name)
                    break
                except Exception as exc:  # reported by settle(): never raised in the thread
                    if conn is not None:
                        conn.close()
                    if kind == "drop" and not tries_left:
                        with self._cond:
                            self._failures.append(f"could not drop schema {name}: {exc}")
                    # A schema not made is made by the next env itself (where a broken
                    # server raises in the test that needs it).
            with self._cond:
                self._current = None
        if conn is not None:
            conn.close()

    def _make(self, conn: psycopg.Connection) -> None:
        name = new_name()
        with self._cond:
            self._current = name
        conn.execute(sql.SQL(QUERIES["schema_create"]).format(sql.Identifier(name)))
        try:
            conn.execute("SELECT set_config('search_path', %s, false)", (name,))
            install(conn, self._script, self._versions)
            conn.execute("RESET search_path")
        except BaseException:
            with self._cond:
                self._drops.append(name)
            raise
        with self._cond:
            self._spare = name


def _drop(conn: psycopg.Connection, name: str) -> None:
    conn.execute(sql.SQL(QUERIES["schema_drop"]).format(sql.Identifier(name)))


_keeper: SchemaKeeper | None = None
_enabled = False
_lock = threading.Lock()


def schemas_in_background(enabled: bool = True) -> None:
    """From now on, TestEnvs on the session's test server take schemas made ahead and leave
    their drop to a thread (see the module's docstring); `False` settles and stops it."""
    global _enabled
    with _lock:
        _enabled = enabled
    if not enabled:
        settle()


def keeper_for(base: str, session_base: str | None) -> SchemaKeeper | None:
    """The keeper for `base`, when enabled and `base` is the session's test server."""
    global _keeper
    with _lock:
        if not _enabled or session_base is None or base != session_base:
            return None
        if _keeper is None:
            _keeper = SchemaKeeper(base)
            atexit.register(_settle_at_exit)
        return _keeper if _keeper.base == base else None


def settle() -> list[str]:
    """Drop every schema queued or made ahead and stop the thread; the failures, if any."""
    global _keeper
    with _lock:
        keeper, _keeper = _keeper, None
    return keeper.settle() if keeper is not None else []


def _settle_at_exit() -> None:
    for failure in settle():
        print(f"cyclone.testing: {failure}", file=sys.stderr)

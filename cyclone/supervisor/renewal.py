"""The session on which the supervisor renews its workers' leases, one statement at a time.

The arbiter decides which leases to renew (`Arbiter.renew_leases`: the busy workers the OS
vouches for) and hands them here; the statement (`steps_renew`, one for all of them) is sent
without waiting for its answer, which arrives on the session's socket, watched by the loop's
selector like the dispatcher's sessions: the loop never waits on the database to renew, and a
kill is never held up by a renewal. A session that fails is dropped and opened again at the
next renewal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import pq

from cyclone.child.session import connect_briefly
from cyclone.engine.renewal import RENEW_PARAMS, RENEW_SQL, renew_params

# A renewal is a handful of primary-key probes: if it takes longer than this, the database is
# in trouble, and the leases are killed for it as their trust runs out anyway.
STATEMENT_TIMEOUT_MS = 2000


class Renewer:
    def __init__(
        self,
        dsn: str,
        *,
        lease_ttl: float,
        watch: Callable[[int], int] | None = None,
        unwatch: Callable[[int], None] | None = None,
    ) -> None:
        self.dsn = dsn
        self.lease_ttl = lease_ttl
        # As the dispatcher's: watch returns the descriptor watched, which unwatch takes.
        self.watch = watch or (lambda fd: fd)
        self.unwatch = unwatch or (lambda fd: None)
        self.conn: psycopg.Connection[Any] | None = None
        self.fd = -1
        self.in_flight = False
        self.statements = 0  # sent, for bench/renewals.py
        self.renewals = 0

    def send(self, leases: list[tuple[int, str]]) -> None:
        pg = self._session()
        params = renew_params(leases, self.lease_ttl)
        values = [None if params[n] is None else str(params[n]).encode() for n in RENEW_PARAMS]
        try:
            pg.send_query_params(RENEW_SQL.encode(), values)
            while pg.flush():  # a few hundred bytes: the socket takes them at once
                pass
        except psycopg.Error:
            self.close()
            raise
        self.in_flight = True
        self.statements += 1
        self.renewals += len(leases)

    def result(self) -> set[int] | None:
        """The step ids renewed, once the answer arrived (None: not yet); raises when the
        statement failed (the session is then dropped)."""
        if self.conn is None:
            return None
        pg = self.conn.pgconn
        try:
            pg.consume_input()
            if pg.is_busy():
                return None
            renewed: set[int] = set()
            error: str | None = None
            while (res := pg.get_result()) is not None:
                if res.status == pq.ExecStatus.TUPLES_OK:
                    renewed.update(int(res.get_value(i, 0) or b"0") for i in range(res.ntuples))
                elif res.status == pq.ExecStatus.FATAL_ERROR:
                    error = (res.error_message or b"").decode(errors="replace").strip()
            if pg.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError(error or "the connection was lost")
            if error is not None:
                raise psycopg.DatabaseError(error)
        except psycopg.Error:
            self.close()
            raise
        self.in_flight = False
        return renewed

    def on_readable(self, arbiter: Any) -> None:
        """Hand the answer to the arbiter (`renewed`, or `renewal_failed`)."""
        try:
            renewed = self.result()
        except psycopg.Error as exc:
            arbiter.renewal_failed(exc)
            return
        if renewed is not None:
            arbiter.renewed(renewed)

    def _session(self) -> pq.abc.PGconn:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.close()
            self.conn = connect_briefly(self.dsn, STATEMENT_TIMEOUT_MS, "cyclone-renew")
            self.conn.pgconn.nonblocking = 1
            self.fd = self.watch(self.conn.pgconn.socket)
        return self.conn.pgconn

    def close(self) -> None:
        if self.conn is not None:
            self.unwatch(self.fd)
            self.conn.close()
            self.conn = None
        self.in_flight = False

"""The supervisor leases for its idle workers and records what they finished, in one statement.

A worker that finished a task (or waits for work) writes a `want` line and waits for the
`given` answer. The supervisor collects the `want`s of one wake-up of its loop and runs one
`steps_dispatch` statement for all of them (cyclone/engine/dispatch.py): what a statement costs
PostgreSQL whatever it does is then paid once per batch instead of once per step. Batches form
by themselves: while one statement runs, the next workers' lines wait in their sockets.

Workers still run one step each and are killed exactly as before: the arbiter learns of each
lease taken here as if its worker had reported it (`leased`), and of each completion (`done`).
What does not fit the one statement (a failure, a join, a map, a child run, a handler's own
transaction, an output too long for a line) the worker records on its own session, then asks
for its next step. When this session fails, every worker is told to lease on its own (`own`)
for a while: the supervisor's loop never waits on a database that does not answer for long.

When its workers' steps are short, a `want` waiting for a whole statement is what bounds them:
the supervisor then leases a few steps ahead in the name of each worker running one (`Ready`),
as River's producer fetches jobs ahead of its workers, and sends them to that worker as they
come (`queued`): the worker keeps them in a queue and, as it finishes a step, starts the next
at once, saying so (`took`) with the task it finished, which the next statement records
(`Taken`), with those of the others. No wake-up of the supervisor, no wait for an answer,
stands between two steps. A worker holds its running lease and AHEAD queued ones at most; a
queued lease is started only while it is young (READY_FOR, `Ready.until`), and given back when
it is not (`expire`), or when its worker leaves without starting it (the arbiter's reaper).
The arbiter knows every queued lease by its worker (`WorkerHandle.queued`): it starts its
watch of one as the `took` line says (the step's timeout counts from then), checks queued
ones for revocation (a cancelled run's queued step is dropped, `drop`), and renews none: a
queued lease lives READY_FOR at most, far less than a lease's term.

A worker that found no step asks again with `park`: its want is kept (`parked`) rather than
answered with nothing, and sent again when a step is made ready anywhere (a notification on
cyclone_ready, migration 22), or every poll interval as the fallback. So that notification is
sent, the dispatcher first says it waits (`wake_arm` sets the flag that the first writer of a
ready step clears as it notifies), then looks once more (a step made ready between its last
look and the flag is found by that look), and waits. One statement polls for all the parked
workers of a VM, where each worker polled on its own before.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from psycopg import pq

from cyclone import codec
from cyclone.child import channel
from cyclone.child.proctitle import worker_name
from cyclone.child.session import connect_briefly
from cyclone.db import HOT_PLANS, prepare_threshold, with_options
from cyclone.engine.dispatch import (
    DISPATCH_PARAMS,
    DISPATCH_PLAIN_SQL,
    DISPATCH_SQL,
    RELEASE_PARAMS,
    RELEASE_SQL,
    Dispatched,
    Finished,
    aged,
    dispatch_params,
    floor_params,
    release,
    release_params,
)
from cyclone.engine.steps import _LeaseFloor
from cyclone.outage import one_line
from cyclone.sql import QUERIES
from cyclone.states import WAKE_SETTLE

log = logging.getLogger(__name__)

# How long the first `want` of a batch may wait for the workers still running a handler to
# ask too: a statement for four costs PostgreSQL about what one for one costs, so a wait this
# short gives back more than it takes (bench/README.md, "runtime.py"). Workers all waiting:
# sent at once.
LINGER = 0.001
# With no worker waiting (only tasks finished by workers that moved on to a queued lease), a
# batch waits this long for more: each worker holds up to AHEAD steps, so none runs dry
# meanwhile. (4 ms with 6 ahead; 1 ms with 8 drains no-op steps faster: bench/README.md,
# "Eight leases ahead".)
TAKEN_LINGER = 0.001
# Sessions whose statements may run at once: one alone would keep every batch on one server
# process, and so on one core, however many the server has.
SESSIONS = 2
# A statement gets as long as the supervisor's other calls into the database.
STATEMENT_TIMEOUT_MS = 2000
# The statement is planned once per session: planning it (a dozen CTEs) costs more than
# running it, and the plan cache kept planning it anew (bench/README.md, "runtime.py").
PLAN_OPTIONS = HOT_PLANS
_PREPARED = b"cyclone_dispatch"
_PREPARED_PLAIN = b"cyclone_dispatch_plain"
# After a session failed, how long workers lease on their own before asking again (they are
# told so in the `given` line; see Worker.ask).
OWN_FOR = 5.0
# A worker waits for its answer; one that does not read it within this long is frozen, and
# the arbiter deals with it as with any silent worker holding a lease.
SEND_TIMEOUT = 1.0
# Leasing ahead is for short steps: with this long a step on average, or longer, a worker
# spends a small share of its time waiting for a statement, and a lease taken ahead would wait
# as long (its attempt's time running) for a worker to be free.
READY_BELOW = 0.02
# How the average step's length follows the last ones (an exponentially weighted average).
DURATION_WEIGHT = 0.2
# The longest a lease taken ahead waits for a worker, and the largest share of its step's time
# to kill it may spend waiting: older, it is given back, its attempt not spent. A rate bucket
# counts a leased step's token taken this long after the lease, and a little more (`slack` in
# cyclone_admit_steps, migration 29): raise both together.
READY_FOR = 0.25
READY_SHARE = 0.05
# Leases queued in each worker's name, at most. A worker that finds none waits for a whole
# statement: with 1, 2, 3 and 4 of them held ready, 4 workers with no-op steps found one for
# 50%, 70%, 84% and 93% of their steps (bench/README.md, "The supervisor leases for its
# workers"); queued in the worker, a lease no longer waits for the supervisor's wake-up. 12
# (with TAKEN_LINGER 1 ms) keep a worker busy through more of its supervisor's statements:
# no-op drains about 15% faster than with 8 (bench/README.md, "Twelve leases ahead"). Fewer for
# longer steps: a queue holds at most half of READY_FOR of work at the average step's length
# (AHEAD_FOR), so that its last lease is not given back for waiting. And fewer for a node with
# a `concurrency` limit (LIMITED_SHARE).
AHEAD = 12
# Leases queued count against a node's `concurrency` (a slot each, claimed by the lease:
# migration 33): while the steps leased are of such a node, the VM's workers are leased ahead
# at most this share of its limit, spread over them (at least one each): asking for more would
# only find the slots taken, and a limit shared by several VMs is better spread over them: 12
# each for 4 workers under 64, 4 each under 16. (Until migration 33 the steps made available
# for a lease held slots too, and half of a limit was the most leases could hold without
# starving them.)
LIMITED_SHARE = 1.0
AHEAD_FOR = READY_FOR / 2
# A finished task whose recording statement failed goes with the next statement, this many
# times at most: its lease then expires, and the step runs again.
TAKEN_TRIES = 3
# The loop wakes this long after a queued lease's `until` to take it back: strictly after it.
EXPIRY_SLACK = 0.001
# Worker names kept made (name_of), a few times a step each.
NAMES_KEPT = 1024
_OWN = b'given {"own":true}\n'
# No lease, nothing recorded: for a finished task, "record it yourself" (its batch failed); for
# a bare want, "no step" (the worker is leaving, or the VM drains).
_SELF = _NONE = b'given {"recorded":null}\n'
# Set the flag, then wait for the transactions in progress (see wake.sql) before looking again.
ARM_SQL = QUERIES["wake_arm"].replace("%(most)s", repr(WAKE_SETTLE))


class DispatchUnreadable(Exception):
    """A dispatch statement's answer that could not be decoded: its batch fails."""


class Handles(Protocol):
    """What the dispatcher needs of the arbiter."""

    children: dict[int, Any]
    draining: bool
    generation: int

    def handed_over(self, handle: Any, leased: channel.Leased) -> Any: ...

    def step_finished(self, lease: Any, done: channel.Done) -> None: ...

    def may_lease(self, handle: Any, finishing: int | None = None) -> bool: ...

    def on_message(self, handle: Any, message: channel.Message) -> None: ...

    def read_channel(self, handle: Any) -> None: ...


Batch = list[tuple[Any, channel.Want]]


@dataclass(slots=True)
class Ready:
    """A lease taken ahead in the name of a worker (`name`), queued for it."""

    row: dict[str, Any]
    sent: float  # when the statement that took it was sent: its lease started no earlier
    name: str
    # The arbiter's config generation it was taken under: after a reload the workers may not
    # serve its workflow any more, so it goes back instead.
    generation: int = 0
    told: bool = False  # its `queued` line was sent to the worker
    revoked: bool = False  # its run was cancelled (or failed) while it was queued

    def fresh(self, now: float, generation: int) -> bool:
        return generation == self.generation and now <= self.until

    @property
    def until(self) -> float:
        """The last moment it may be started: READY_FOR after its statement was sent, and
        no later than READY_SHARE of its step's time to kill."""
        kill_after = self.row["kill_after"]
        if kill_after is None:
            return self.sent + READY_FOR
        return self.sent + min(READY_FOR, READY_SHARE * kill_after)

    @property
    def key(self) -> tuple[int, str]:
        return self.row["id"], self.row["lease_token"]

    def started(self, at: float) -> channel.Leased:
        """The `leased` report of its step as its worker started it, at `at`."""
        return leased(aged(self.row, at - self.sent), self.sent)

    def line(self) -> bytes:
        return (
            f'queued {{"since":{self.sent!r},"until":{self.until!r},'
            f'"lease":{codec.dumps(self.row)}}}\n'
        ).encode()


@dataclass(slots=True)
class Taken:
    """A finished task whose worker already took its next step: recorded by a later statement,
    its outcome then reported to the arbiter for the lease it was (`held`)."""

    held: Any
    finished: dict[str, Any]
    duration: float
    tries: int = 0


class Session:
    """A database session of the dispatcher, with at most one statement in flight."""

    def __init__(self, dsn: str) -> None:
        self.conn = connect_briefly(
            with_options(dsn, PLAN_OPTIONS), STATEMENT_TIMEOUT_MS, "cyclone-dispatch"
        )
        self.pg = self.conn.pgconn
        # Behind a pooler in transaction mode a named statement may be gone, or another's.
        self.prepared = prepare_threshold() is not None
        if self.prepared:
            for name, sql in ((_PREPARED, DISPATCH_SQL), (_PREPARED_PLAIN, DISPATCH_PLAIN_SQL)):
                result = self.pg.prepare(name, sql.encode())
                if result.status != pq.ExecStatus.COMMAND_OK:
                    raise psycopg.OperationalError(_message(result))
        self.pg.nonblocking = 1
        self.fd = self.pg.socket  # kept: a lost connection has none to tell any more
        self.watched = -1  # the descriptor the loop watches for it (Dispatcher.watch)
        self.floor = _LeaseFloor()
        self.batch: Batch | None = None
        self.leasing: list[Any] = []
        self.taken: list[Taken] = []
        self.ahead: list[Any] = []  # the workers it takes leases ahead for
        self.releasing: list[Ready] = []  # in flight: steps_release, not steps_dispatch
        self.arming = False  # in flight: wake_arm
        self.generation = 0  # the arbiter's, as the statement in flight was sent
        self.sent = 0.0

    @property
    def busy(self) -> bool:
        return self.batch is not None or bool(self.releasing) or self.arming

    def fileno(self) -> int:
        return self.fd

    def send(self, params: dict[str, str | None], limited: bool = True) -> None:
        """steps_dispatch, or with `limited` false steps_dispatch_plain (engine/dispatch.py)."""
        values = _values(params, DISPATCH_PARAMS)
        if self.prepared:
            self.pg.send_query_prepared(_PREPARED if limited else _PREPARED_PLAIN, values)
        else:
            sql = DISPATCH_SQL if limited else DISPATCH_PLAIN_SQL
            self.pg.send_query_params(sql.encode(), values)
        self.flush()

    def send_release(self, ready: list[Ready]) -> None:
        """Give back leases taken ahead (rare: sent unprepared)."""
        params = release_params([(r.row["id"], r.row["lease_token"]) for r in ready])
        self.releasing = ready
        self.pg.send_query_params(RELEASE_SQL.encode(), _values(params, RELEASE_PARAMS))
        self.flush()

    def send_arm(self) -> None:
        """Say that this VM waits for ready steps (rare: once per idle spell; unprepared)."""
        self.arming = True
        self.pg.send_query(ARM_SQL.encode())
        self.flush()

    def flush(self) -> None:
        while self.pg.flush():  # what the socket did not take at once: a few kB at most
            select.select([], [self.fileno()], [], STATEMENT_TIMEOUT_MS / 1000)

    def result(self) -> str | None:
        """The statement's JSON once it arrived (None: not yet); raises when it failed."""
        self.pg.consume_input()
        if self.pg.is_busy():
            return None
        text, error = None, None
        while (result := self.pg.get_result()) is not None:
            if result.status == pq.ExecStatus.TUPLES_OK:
                text = (result.get_value(0, 0) or b"").decode()
            elif result.status == pq.ExecStatus.FATAL_ERROR:
                error = psycopg.DatabaseError(_message(result))
        if self.pg.status != pq.ConnStatus.OK:
            # The server ended the session (a restart, say): a failure of the database, which
            # the workers are told to ride out on their own, not of this batch alone.
            raise psycopg.OperationalError(str(error or "the connection was lost"))
        if error is not None:
            raise error
        if text is None:
            raise psycopg.DatabaseError("the dispatch statement returned nothing")
        return text

    def close(self) -> None:
        self.conn.close()


def _values(params: dict[str, str | None], names: Sequence[str]) -> list[bytes | None]:
    """A statement's parameters in its order, as libpq takes them."""
    return [None if v is None else v.encode() for v in (params[n] for n in names)]


def _message(result: pq.abc.PGresult) -> str:
    return (result.error_message or b"").decode(errors="replace").strip()


class Dispatcher:
    def __init__(
        self,
        dsn: str,
        *,
        workflows: Callable[[], Sequence[str]],
        lease_ttl: float,
        graphs: Callable[[], Sequence[str] | None] | None = None,
        watch: Callable[[int], int] | None = None,
        unwatch: Callable[[int], None] | None = None,
        sessions: int = SESSIONS,
        observe: Callable[[int], None] | None = None,
        caps: Callable[[], Mapping[str, int]] | None = None,
        queue_of: Callable[[str], str] | None = None,
        poll: float = 1.0,
        listening: Callable[[], bool] | None = None,
        limited: Callable[[], bool] | None = None,
    ) -> None:
        self.dsn = dsn
        # Parked wants are looked for again this often, notified or not.
        self.poll = poll
        # Whether notifications reach this supervisor: without, setting the flag is no use.
        self.listening = listening or (lambda: False)
        self.parked: Batch = []
        self.parked_at = 0.0  # when the parked wants were last looked for
        self.armed = False  # the flag is set for us, as far as we know (no notification since)
        self.arm = False  # the parked wait for the flag to be set, then for one more look
        self.arm_sent = False  # a statement setting it is in flight (one at a time)
        # Notifications so far, and their count as the statement in flight was sent: one that
        # came meanwhile may have cleared the flag that statement set.
        self.wakes = 0
        self.arm_wakes = 0
        self.workflows = workflows
        # The graph versions its code can run (engine/versions.py): only their steps are leased.
        self.graphs = graphs or (lambda: None)
        # Whether any of them limits a node's concurrency (Served.limited): without, the
        # statement leaves out the steps of such nodes, and the probe for them.
        self.limited = limited or (lambda: True)
        # [supervisor] queues' caps: at most so many of this VM's workers hold a step of each
        # capped queue (`capped`); a workflow's queue.
        self.caps = caps or (lambda: {})
        self.queue_of = queue_of or (lambda workflow: "default")
        self.lease_ttl = lease_ttl
        # watch(fd) returns the descriptor the loop watches for it (its own: see
        # Supervisor.watch_session); unwatch and on_readable take that one.
        self.watch = watch or (lambda fd: fd)
        self.unwatch = unwatch or (lambda fd: None)
        self.size = sessions
        self.observe = observe or (lambda leased: None)
        self.sessions: list[Session] = []
        self.pending: Batch = []
        # Whether the step a worker finished was recorded, for a worker whose answer waits
        # for a second statement (see `answer`), by pid.
        self.carried: dict[int, bool] = {}
        self.own_until = 0.0
        self.first_at = 0.0
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.names: dict[tuple[int, int], str] = {}  # name_of's, by worker number and pid
        self.stale: list[Ready] = []  # to give back, with the next free session
        self.untold: list[Any] = []  # workers with queued leases not sent to them yet
        self.expiry = math.inf  # the soonest `until` of a queued lease (see expire)
        self.taken: list[Taken] = []
        self.duration = READY_BELOW  # the average step length workers report: none yet
        # The smallest `concurrency` of the nodes the last leases were steps of (None: none of
        # them was limited): it caps how many are leased ahead (see LIMITED_SHARE).
        self.node_limit: int | None = None

    def next_at(self) -> float | None:
        """When the `want`s waiting for others must be sent, or the parked looked for again
        (the loop wakes for it). None while every session has a statement in flight: the
        first answer wakes the loop (a time already past would have it spin until then)."""
        times = []
        if (self.pending or self.taken) and self.first_at:
            times.append(max(self.first_at + self.linger(), self.own_until))
        if self.parked and not self.arm:
            times.append(self.parked_at + self.poll)
        if len(self.sessions) >= self.size and all(s.busy for s in self.sessions):
            times = []
        if self.expiry < math.inf:
            times.append(self.expiry + EXPIRY_SLACK)  # needs no session: see expire
        return min(times, default=None)

    def linger(self) -> float:
        return LINGER if self.pending else TAKEN_LINGER

    def only_taken(self) -> bool:
        """Whether what waits to be sent is only tasks finished by workers that moved on (no
        worker waits for an answer): the loop may let more lines pile up (Supervisor.wait)."""
        return bool(self.taken) and not self.pending

    def want(self, handle: Any, message: channel.Want | channel.Took, held: Any = None) -> None:
        if message.duration is not None:
            self.duration += DURATION_WEIGHT * (message.duration - self.duration)
        if isinstance(message, channel.Took):
            # It started a queued lease (the arbiter saw to that) having finished this task.
            if message.finished is not None:
                self.taken.append(Taken(held, message.finished, message.duration or 0.0))
                if not self.first_at:
                    self.first_at = time.monotonic()
            return
        if self.parked:
            # Its worker asks again while parked: it is leaving (see Worker.ask).
            self.parked = [(h, w) for h, w in self.parked if h is not handle]
        if not message.lease and message.finished is None:
            send_line(handle.fd, _NONE)
            return
        self.pending.append((handle, message))

    def wake(self) -> None:
        """A step was made ready (cyclone_ready): the flag was cleared as it was notified.
        The parked are looked for at once."""
        self.armed = False
        self.wakes += 1
        self.parked_at = 0.0

    def park(self, handle: Any, want: channel.Want) -> None:
        if not self.parked:
            self.parked_at = time.monotonic()
        self.parked.append((handle, want))
        if not self.armed and self.listening():
            self.arm = True

    def unpark(self, arbiter: Handles, now: float) -> None:
        """Answer the parked of a draining VM with nothing; move those due for a look (the
        poll interval passed, or a notification came) to the wants to send."""
        if not self.parked:
            return
        self.parked = [(h, w) for h, w in self.parked if arbiter.children.get(h.pid) is h]
        if not arbiter.draining and any(h.queued for h, _ in self.parked):
            # Leases were queued for it meanwhile: handed over at once (hand_over).
            self.pending += [(h, w) for h, w in self.parked if h.queued]
            self.parked = [(h, w) for h, w in self.parked if not h.queued]
        if arbiter.draining:
            for handle, _ in self.parked:
                send_line(handle.fd, _NONE)
            self.parked, self.arm = [], False
        elif not self.arm and (now >= self.parked_at + self.poll or now < self.own_until):
            self.pending += self.parked
            self.parked = []

    def close(self) -> None:
        # Those whose release is in flight too: the session closes under it (twice is harmless:
        # a release is fenced by the lease's token).
        self.give_back(self.stale + [r for s in self.sessions for r in s.releasing])
        self.stale = []
        for session in self.sessions:
            self.unwatch(session.watched)
            session.close()
        self.sessions = []

    # --- leases taken ahead -------------------------------------------------------------------

    def hand_over(self, arbiter: Handles, now: float) -> None:
        """Answer at once each worker that waits for a step while leases are queued in its
        name (its `want` crossed their lines, or it waited when they came): the first of
        them, which it then drops from its own queue."""
        if self.stale and (session := self.free_session()) is not None:
            stale, self.stale = self.stale, []
            try:
                session.send_release(stale)
            except psycopg.Error as exc:
                self.failed(session, exc, arbiter)
        waiting: Batch = []
        for handle, want in self.pending:
            finished = want.finished
            step_id = finished["step_id"] if finished else None
            while handle.queued and handle.queued[0].revoked:
                # Its worker drops it (the `drop` line came before this answer will).
                handle.queued.pop(0)
            if not (handle.queued and want.lease and arbiter.may_lease(handle, step_id)):
                waiting.append((handle, want))
                continue
            ready = handle.queued.pop(0)
            ready.row = aged(ready.row, now - ready.sent)
            report = leased(ready.row, ready.sent)
            if finished is None:
                arbiter.on_message(handle, report)
            else:
                held = arbiter.handed_over(handle, report)
                self.taken.append(Taken(held, finished, want.duration or 0.0))
                if not self.first_at:
                    self.first_at = now
            body = {"taken": True, "since": ready.sent, "lease": ready.row}
            send_line(handle.fd, f"given {codec.dumps(body)}\n".encode())
        self.pending = waiting

    def queue(self, handle: Any, ready: Ready) -> None:
        """Queue a lease taken ahead in this worker's name (sent to it by `tell`)."""
        if not any(not r.told for r in handle.queued):
            self.untold.append(handle)
        handle.queued.append(ready)
        self.expiry = min(self.expiry, ready.until)

    def tell(self, arbiter: Handles) -> None:
        """Send each worker the leases queued for it since, in one write."""
        untold, self.untold = self.untold, []
        for handle in untold:
            lines = [r for r in handle.queued if not r.told]
            if not lines or arbiter.children.get(handle.pid) is not handle:
                continue
            for ready in lines:
                ready.told = True
            # A worker that does not read them (gone, frozen) never starts them: they expire.
            send_line(handle.fd, b"".join(r.line() for r in lines))

    def expire(self, arbiter: Handles, now: float) -> None:
        """Take back the queued leases no longer young (`Ready.until` passed), for steps_release.

        Its worker's lines are read first, to their end: a worker writes `took` before it
        checks the lease's age against the same `until`, on the same clock, so a lease it
        started has its line read here, and one whose line is not there was not started (nor
        will be: the worker finds it too old). Revoked ones go the same way (a release of
        those changes nothing)."""
        if now <= self.expiry:
            return
        soonest = math.inf
        for handle in list(arbiter.children.values()):
            if not handle.queued:
                continue
            if any(now > r.until for r in handle.queued):
                arbiter.read_channel(handle)
                kept = []
                for ready in handle.queued:
                    (kept if now <= ready.until else self.stale).append(ready)
                handle.queued = kept
            soonest = min([soonest, *(r.until for r in handle.queued)])
        self.expiry = soonest

    def release_later(self, queued: list[Ready]) -> None:
        """Give back leases queued for a worker that left without starting them (the arbiter
        saw its exit, and read its last lines): with the next free session."""
        self.stale += queued

    def revoked(self, handle: Any, ready: Ready) -> None:
        """A queued lease's run was cancelled or failed: its worker must not start it."""
        if ready.revoked:
            return
        ready.revoked = True
        if not ready.told:
            handle.queued.remove(ready)  # never sent: nothing to take back
            return
        step_id, token = ready.key
        send_line(handle.fd, f'drop {{"step_id":{step_id},"token":"{token}"}}\n'.encode())

    def name_of(self, handle: Any) -> str:
        """The worker's name in leased_by: what it would write itself (child/proctitle.py)."""
        key = (handle.number, handle.pid)
        name = self.names.get(key)
        if name is None:
            if len(self.names) >= NAMES_KEPT:
                self.names.clear()  # workers come and go: the live ones are made again
            name = self.names[key] = worker_name(self.host, self.pid, handle.number, handle.pid)
        return name

    def ahead(self, arbiter: Handles, leasing: list[Any]) -> list[Any]:
        """The workers to lease ahead for, once per lease: AHEAD queued for each worker about
        to run a step (in `leasing`) or running one for less than READY_BELOW, when the
        steps are short (READY_BELOW), fewer as they are longer (AHEAD_FOR), less those
        queued or being taken already."""
        if self.duration >= READY_BELOW or arbiter.draining:
            return []
        depth = min(AHEAD, max(1, int(AHEAD_FOR / self.duration))) if self.duration else AHEAD
        if self.node_limit is not None:
            depth = min(depth, limited_depth(self.node_limit, len(arbiter.children)))
        asked = Counter(id(h) for session in self.sessions for h in session.ahead)
        serving = {id(h) for h in leasing}
        # A worker whose step has run this long already is not about to ask.
        recent = time.monotonic() - READY_BELOW
        return [
            h for h in arbiter.children.values()
            if (id(h) in serving or (h.lease is not None and h.lease.leased_at >= recent))
            and arbiter.may_lease(h, h.lease.step_id if h.lease is not None else None)
            for _ in range(depth - len(h.queued) - asked[id(h)])
        ]  # fmt: skip

    def give_back(self, ready: list[Ready]) -> None:
        """Return leases taken ahead that no worker took (the supervisor stops), their
        attempts not spent: waiting for it, once, as it leaves."""
        if not ready:
            return
        try:
            with connect_briefly(self.dsn, STATEMENT_TIMEOUT_MS, "cyclone-dispatch") as conn:
                release(conn, [(r.row["id"], r.row["lease_token"]) for r in ready])
        except psycopg.Error as exc:
            # They come back through lease expiry instead (an attempt spent each).
            log.warning("could not give back %d leases taken ahead: %s", len(ready), exc)

    # --- sending ------------------------------------------------------------------------------

    def flush(self, arbiter: Handles) -> None:
        """Send the `want`s collected so far on a free session (or answer them at once)."""
        # A worker reaped since its line was read is gone, and its descriptor closed (and
        # perhaps reused by a newer worker's): nothing is sent to it.
        self.pending = [(h, w) for h, w in self.pending if arbiter.children.get(h.pid) is h]
        now = time.monotonic()
        self.expire(arbiter, now)
        self.unpark(arbiter, now)
        if self.arm and not self.arm_sent and (session := self.free_session()) is not None:
            self.arm_sent, self.arm_wakes = True, self.wakes
            try:
                session.send_arm()
            except psycopg.Error as exc:
                self.failed(session, exc, arbiter)
        if now < self.own_until:
            batch, self.pending = self.pending, []
            for handle, _ in batch:
                send_line(handle.fd, _OWN)
            self.tell(arbiter)
            return
        self.hand_over(arbiter, now)
        if self.untold:
            self.tell(arbiter)
        if not (self.pending or self.taken):
            return
        if not self.first_at:
            self.first_at = now
        # Workers still running a step, or waiting for the answer to a statement in flight
        # (a finished step is held until its `want` is answered).
        running = sum(
            1 for h in arbiter.children.values() if h.lease is not None and h.kill is None
        ) - sum(1 for _, w in self.pending if w.finished)
        if (running > 0 or not self.pending) and now < self.first_at + self.linger():
            return
        session = self.free_session()
        if session is None:
            return  # they go with the next statement, once one of those in flight is back
        batch, self.pending = self.pending, []
        taken, self.taken = self.taken, []
        self.first_at = 0.0
        finished = [Finished(**w.finished) for _, w in batch if w.finished]
        finished += [Finished(**t.finished) for t in taken]
        leasing = [
            h for h, w in batch
            if w.lease and arbiter.may_lease(h, w.finished["step_id"] if w.finished else None)
        ]  # fmt: skip
        workflows, room = self.capped(arbiter, batch)
        if room is not None:
            # Answered with no step, the others ask again at their next poll.
            leasing = leasing[:room]
        ahead = self.ahead(arbiter, leasing) if room is None else []
        params = dispatch_params(
            finished, [self.name_of(h) for h in leasing + ahead],
            workflows=workflows, lease_ttl=self.lease_ttl, graphs=self.graphs(),
        )  # fmt: skip
        params.update(floor_params(session.floor))
        session.batch, session.leasing, session.sent = batch, leasing, time.monotonic()
        session.taken, session.ahead, session.generation = taken, ahead, arbiter.generation
        try:
            session.send(params, self.limited())
        except psycopg.Error as exc:
            self.failed(session, exc, arbiter)

    def capped(self, arbiter: Handles, batch: Batch) -> tuple[tuple[str, ...], int | None]:
        """The workflows this statement may lease, and at most how many leases it may take
        (None: as many as asked), under the queues' caps: a capped queue's workers hold a
        step each (less those finishing in `batch`), and every lease a statement in flight
        may take counts against every capped queue, whichever it turns out to be."""
        served = tuple(self.workflows())
        caps = self.caps()
        if not caps:
            return served, None
        finishing = {id(h) for h, w in batch if w.finished}
        held = Counter(
            self.queue_of(h.lease.workflow) for h in arbiter.children.values()
            if h.lease is not None and id(h) not in finishing
        )  # fmt: skip
        held.update(
            self.queue_of(r.row["workflow"]) for h in arbiter.children.values() for r in h.queued
        )  # fmt: skip
        flying = sum(len(s.leasing) + len(s.ahead) for s in self.sessions if s.batch is not None)
        spare = {queue: cap - held[queue] - flying for queue, cap in caps.items()}
        allowed = tuple(w for w in served if spare.get(self.queue_of(w), 1) > 0)
        rooms = {spare[self.queue_of(w)] for w in allowed if self.queue_of(w) in spare}
        return allowed, (min(rooms) if rooms else None)

    def free_session(self) -> Session | None:
        for session in self.sessions:
            if not session.busy:
                return session
        if len(self.sessions) >= self.size:
            return None
        try:
            session = Session(self.dsn)
        except psycopg.Error as exc:
            self.own(exc, self.pending)
            self.pending = []
            return None
        self.sessions.append(session)
        session.watched = self.watch(session.fileno())
        return session

    # --- receiving ----------------------------------------------------------------------------

    def on_readable(self, fd: int, arbiter: Handles) -> None:
        session = next((s for s in self.sessions if s.watched == fd), None)
        if session is None:
            return
        try:
            text = session.result()
        except psycopg.Error as exc:
            self.failed(session, exc, arbiter)
            return
        if text is not None and session.releasing:
            session.releasing = []
            self.flush(arbiter)
            return
        if text is not None and session.arming:
            # Armed: one more look for the parked, in a snapshot taken after the flag was set
            # (a step made ready before it notified nobody, and is found by this look).
            session.arming, self.arm, self.arm_sent = False, False, False
            self.armed = self.wakes == self.arm_wakes
            self.pending += self.parked
            self.parked = []
            self.flush(arbiter)
            return
        if text is None or session.batch is None:
            return
        batch, leasing, sent = session.batch, session.leasing, session.sent
        taken, ahead = session.taken, session.ahead
        session.batch, session.leasing, session.taken, session.ahead = None, [], [], []
        try:
            try:
                result = Dispatched.parse(text)
            except RecursionError:
                # A row the client's checks never saw (an input nested too deep for json,
                # written by SQL or an old client): read flat, that row's lease left out.
                result = Dispatched.parse_flat(text)
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
            # Unreadable all the same: this batch fails as a failed statement does, and the
            # supervisor goes on. Its leases lapse; the scanner reclaims them.
            session.batch, session.taken, session.ahead = batch, taken, ahead
            self.failed(session, DispatchUnreadable(f"{type(exc).__name__}: {exc}"), arbiter)
            return
        self.observe(len(result.leases))
        if result.leases:
            limits = [r.get("node_limit") for r in result.leases.values()]
            self.node_limit = min((n for n in limits if n is not None), default=None)
        self.answer(result, batch, leasing, sent, session, arbiter)
        for taken_one in taken:
            step_id = taken_one.finished["step_id"]
            outcome = "completed" if step_id in result.completed else "lost"
            if outcome == "lost":
                log.warning("step %d: lease lost, result discarded", step_id)
            arbiter.step_finished(taken_one.held, channel.Done(
                step_id, outcome, taken_one.duration, token=taken_one.finished["token"]
            ))  # fmt: skip
        now = time.monotonic()
        for i, handle in enumerate(ahead):
            row = result.leases.get(len(leasing) + i)
            if row is None:
                continue
            ready = Ready(row, sent, self.name_of(handle), session.generation)
            if self.may_queue(handle, ready, arbiter, now):
                self.queue(handle, ready)
            else:
                self.stale.append(ready)
        self.flush(arbiter)

    def may_queue(self, handle: Any, ready: Ready, arbiter: Handles, now: float) -> bool:
        """Whether a lease taken ahead in this worker's name is queued for it: not when it
        left, leaves, was killed, serves an old config, or holds AHEAD already."""
        return (
            arbiter.children.get(handle.pid) is handle and ready.fresh(now, arbiter.generation)
            and handle.generation == arbiter.generation and len(handle.queued) < AHEAD
            and arbiter.may_lease(handle, handle.lease.step_id if handle.lease else None)
        )  # fmt: skip

    def answer(
        self, result: Dispatched, batch: Batch, leasing: list[Any], sent: float,
        session: Session, arbiter: Handles,
    ) -> None:  # fmt: skip
        slot = {id(h): i for i, h in enumerate(leasing)}
        # Nothing from the session's place in the index (or only steps of the runs just
        # finished, which the statement skips): the workers left without a step ask again at
        # once, in the next statement, which looks from the start.
        rescan = session.floor.taken(result.last())
        again = rescan or len(result.leases) < len(leasing)
        for handle, want in batch:
            recorded = self.carried.pop(handle.pid, None)
            if want.finished is not None:
                step_id = want.finished["step_id"]
                recorded = step_id in result.completed
                outcome = "completed" if recorded else "lost"
                arbiter.on_message(handle, channel.Done(
                    step_id, outcome, want.duration or 0.0, token=want.finished["token"]
                ))  # fmt: skip
            row = result.leases.get(slot.get(id(handle), -1))
            if row is not None:
                arbiter.on_message(handle, leased(row, sent))
            elif again and id(handle) in slot and want.finished is not None:
                # Recorded; its worker still waits for a step: asked for in the next statement.
                self.pending.append((handle, channel.Want(lease=True)))
                if recorded is not None:
                    self.carried[handle.pid] = recorded
                continue
            elif want.park and not arbiter.draining:
                if rescan and id(handle) in slot:
                    self.pending.append((handle, want))  # looked from the start next
                else:
                    self.park(handle, want)
                continue
            send_line(handle.fd, given_line(recorded, row, sent))

    def failed(self, session: Session, exc: Exception, arbiter: Handles) -> None:
        batch, session.batch = session.batch or [], None
        if session.arming:
            # The flag may not be set: the parked wait for the poll interval instead.
            session.arming, self.arm, self.arm_sent = False, False, False
            self.parked_at = time.monotonic()
        # Leases being given back expire instead, an attempt spent each.
        session.releasing = []
        # Finished tasks whose workers moved on: tried again with a later statement (their
        # completions are fenced, so a statement that did commit after all changes nothing).
        retry = [t for t in session.taken if t.tries + 1 < TAKEN_TRIES]
        for t in retry:
            t.tries += 1
        if len(retry) < len(session.taken):
            log.warning("%d finished steps could not be recorded; they run again once their "
                        "leases expire", len(session.taken) - len(retry))  # fmt: skip
        self.taken = retry + self.taken
        session.taken, session.ahead = [], []
        if session in self.sessions:
            self.sessions.remove(session)
            self.unwatch(session.watched)
            session.close()
        if isinstance(exc, psycopg.OperationalError):
            self.own(exc, batch)
        else:
            # This batch alone (a deadlock, say): its workers record their steps themselves. A
            # parked worker (it had nothing to record) stays parked, looked for again when a
            # step is made ready or at the poll: answered with nothing, it slept a poll interval
            # and no wake-up reached it meanwhile.
            log.warning("a dispatch statement failed; its workers record on their own: %s", exc)
            for handle, want in batch:
                if arbiter.children.get(handle.pid) is not handle:
                    continue
                if want.park and want.finished is None and not arbiter.draining:
                    self.park(handle, want)
                else:
                    send_line(handle.fd, _SELF)

    def own(self, exc: Exception, batch: Batch) -> None:
        log.warning("cannot lease for the workers (they lease on their own for %.0fs): %s",
                    OWN_FOR, one_line(exc))  # fmt: skip
        self.own_until = time.monotonic() + OWN_FOR
        for handle, _ in batch:
            send_line(handle.fd, _OWN)


def limited_depth(node_limit: int, workers: int) -> int:
    """How many leases may be queued for each of `workers` workers when the steps leased are
    of a node limited to `node_limit` at once: LIMITED_SHARE of it over them all, and at least
    one each."""
    return max(1, int(node_limit * LIMITED_SHARE) // max(workers, 1))


def leased(row: dict[str, Any], sent: float) -> channel.Leased:
    """The `leased` report the worker would have sent for a lease taken here."""
    return channel.Leased(
        step_id=row["id"], token=row["lease_token"], run_id=row["run_id"],
        workflow=row["workflow"], node=row["node"], attempt=row["attempt"],
        kill_after=row["kill_after"], deadline_left=row["deadline_left"], since=sent,
        item=row["item_index"],
    )  # fmt: skip


def given_line(recorded: bool | None, row: dict[str, Any] | None, sent: float) -> bytes:
    """The answer to a `want`: a lease row goes on whole, input and item included."""
    body: dict[str, Any] = {"recorded": recorded, "since": sent}
    if row is not None:
        body["lease"] = row
    return f"given {codec.dumps(body)}\n".encode()


def send_line(fd: int, data: bytes, timeout: float = SEND_TIMEOUT) -> bool:
    """Write all of `data` to a worker's non-blocking socket; False if it is gone or frozen."""
    deadline = time.monotonic() + timeout
    while data:
        try:
            written = os.write(fd, data)
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([], [fd], [], left)
            continue
        except OSError:
            return False  # gone: the arbiter reaps it and records the lease it held
        data = data[written:]
    return True

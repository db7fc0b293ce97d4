"""Leases taken ahead: queued in the name of a worker running short steps and sent to it; the
worker starts one as it finishes a step (`took`), and the supervisor records the step with its
next statement; a queued lease no worker started in time is given back, and never one it did."""

from __future__ import annotations

import json
import os
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

import cyclone
from cyclone.child import channel
from cyclone.child.channel import LineBuffer
from cyclone.child.proctitle import worker_name
from cyclone.engine import steps as engine_steps
from cyclone.engine.dispatch import finished_json, lease_of
from cyclone.supervisor import dispatch as dispatch_module
from cyclone.supervisor.children import held_lease
from cyclone.supervisor.dispatch import AHEAD, Dispatcher
from cyclone.testing import TestEnv

quick = cyclone.Workflow("dispatch-ahead")


@quick.task()
def only(ctx):
    return ctx.input


@dataclass
class Handle:
    pid: int
    fd: int
    peer: socket.socket
    lease: Any = None
    kill: Any = None
    number: int = 1
    generation: int = 0
    queued: list = field(default_factory=list)
    buffer: LineBuffer = field(default_factory=LineBuffer)


@dataclass
class Arbiter:
    """What the dispatcher asks of the arbiter, recording what it is told; a worker's `took`
    lines are acted on as the arbiter does (Arbiter.took)."""

    children: dict[int, Handle] = field(default_factory=dict)
    draining: bool = False
    generation: int = 0
    notified: bool = False
    later: list[tuple[int, str]] = field(default_factory=list)
    dispatcher: Any = None

    def may_lease(self, handle: Handle, finishing: int | None = None) -> bool:
        held = handle.lease
        return not self.draining and (held is None or held.step_id == finishing)

    def on_message(self, handle: Handle, message: channel.Message) -> None:
        if isinstance(message, channel.Leased):
            handle.lease = held_lease(message, time.monotonic())
        elif isinstance(message, channel.Done):
            handle.lease = None
        elif isinstance(message, channel.Took):
            held = None
            if message.finished is not None:
                held, handle.lease = handle.lease, None
            ready = next(r for r in handle.queued if r.key == (message.step_id, message.token))
            handle.queued.remove(ready)
            handle.lease = held_lease(ready.started(message.at), message.at)
            self.dispatcher.want(handle, message, held)

    def handed_over(self, handle: Handle, leased: channel.Leased) -> Any:
        finished = handle.lease
        self.on_message(handle, leased)
        return finished

    def step_finished(self, lease: Any, done: channel.Done) -> None:
        assert lease.step_id == done.step_id
        self.later.append((done.step_id, done.outcome))

    def read_channel(self, handle: Handle) -> None:
        """The worker's lines (its `took`s), read to their end."""
        ours = socket.socket(fileno=os.dup(handle.fd))
        try:
            while select.select([ours], [], [], 0)[0]:
                for line in handle.buffer.feed(ours.recv(1 << 16)):
                    self.on_message(handle, channel.decode(line))
        finally:
            ours.close()


class Harness:
    def __init__(self, env: TestEnv, workers: int, **options: Any) -> None:
        self.env = env
        self.arbiter = Arbiter()
        options.setdefault("workflows", lambda: (quick.name,))
        self.dispatcher = Dispatcher(env.dsn, lease_ttl=30.0, **options)
        self.arbiter.dispatcher = self.dispatcher
        self.dispatcher.duration = 0.0  # the steps are short: it leases ahead
        self._keep: list[socket.socket] = []
        # What each worker read of its supervisor's lines, besides the answers.
        self.queue: dict[int, list[channel.Queued]] = {}
        self.dropped: dict[int, list[channel.Drop]] = {}
        self._buffers: dict[int, LineBuffer] = {}
        for pid in range(1, workers + 1):
            ours, theirs = socket.socketpair()
            ours.setblocking(False)
            self.arbiter.children[pid] = Handle(pid, ours.fileno(), theirs)
            self._keep.append(ours)
            self.queue[pid], self.dropped[pid] = [], []

    def want(self, pid: int, finished: Any = None) -> None:
        handle = self.arbiter.children[pid]
        message = channel.Want(lease=True, duration=0.001, finished=finished)
        self.dispatcher.want(handle, message)

    def read(self, pid: int, timeout: float = 0.0) -> channel.Given | None:
        """What came for this worker: its queued leases and drops are kept; an answer is
        returned."""
        peer = self.arbiter.children[pid].peer
        buffer = self._buffers.setdefault(pid, LineBuffer())
        given = None
        while select.select([peer], [], [], timeout)[0]:
            for line in buffer.feed(peer.recv(1 << 16)):
                message = channel.decode(line)
                if isinstance(message, channel.Queued):
                    self.queue[pid].append(message)
                elif isinstance(message, channel.Drop):
                    self.dropped[pid].append(message)
                else:
                    assert isinstance(message, channel.Given) and given is None
                    given = message
            timeout = 0.0
        return given

    def answer(self, pid: int, timeout: float = 10.0) -> channel.Given:
        """Run the loop until this worker's answer arrives, and read it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.dispatcher.flush(self.arbiter)
            given = self.read(pid)
            if given is not None:
                if given.lease is not None:  # a queued one, handed over: the worker drops it
                    step_id = given.lease["id"]
                    self.queue[pid] = [q for q in self.queue[pid] if q.lease["id"] != step_id]
                return given
            self.pump(0.01)
        raise AssertionError(f"no answer for worker {pid}")

    def took(self, pid: int, finished: Any = None, read: bool = True) -> channel.Queued:
        """As the worker does: start its first queued lease, saying so (`took`), with the task
        it finished; the arbiter reads the line at once, unless not `read`."""
        self.read(pid)
        queued = self.queue[pid].pop(0)
        handle = self.arbiter.children[pid]
        line = channel.Took(
            step_id=queued.lease["id"], token=queued.lease["lease_token"], at=time.monotonic(),
            duration=0.001, finished=finished,
        )  # fmt: skip
        handle.peer.sendall(channel.encode(line))
        if read:
            self.arbiter.read_channel(handle)
        return queued

    def pump(self, timeout: float) -> None:
        fds = [s.fileno() for s in self.dispatcher.sessions if s.busy]
        ready = select.select(fds, [], [], timeout)[0] if fds else []
        for fd in ready:
            self.dispatcher.on_readable(fd, self.arbiter)

    def settle(self, timeout: float = 10.0) -> None:
        """Until nothing is waiting or in flight."""
        deadline = time.monotonic() + timeout
        d = self.dispatcher
        while d.pending or d.taken or d.stale or d.untold or any(s.busy for s in d.sessions):
            assert time.monotonic() < deadline, "the dispatcher never settled"
            d.flush(self.arbiter)
            self.pump(0.01)
        for pid in self.arbiter.children:
            self.read(pid)

    def finished(self, given: channel.Given | channel.Queued, output: Any) -> dict[str, Any]:
        lease = lease_of(given.lease, 30.0)
        text = finished_json(self.env.conn, lease, json.dumps(output))
        assert text is not None
        return json.loads(text)

    def steps(self) -> list[dict[str, Any]]:
        return self.env.conn.execute(
            "SELECT id, state, attempt, leased_by FROM cyclone_steps ORDER BY id"
        ).fetchall()

    def states(self, ids: list[int]) -> list[tuple[str, int]]:
        steps = {s["id"]: s for s in self.steps()}
        return [(steps[i]["state"], steps[i]["attempt"]) for i in ids]

    def close(self) -> None:
        self.dispatcher.close()
        for handle in self.arbiter.children.values():
            handle.peer.close()
        for sock in self._keep:
            sock.close()


@pytest.fixture
def harness(env: TestEnv):
    env.register(quick)
    h = Harness(env, workers=2)
    yield h
    h.close()


def test_leases_taken_ahead_are_queued_in_their_workers_name_and_sent_to_it(harness) -> None:
    runs = harness.env.client.submit_many(quick, list(range(AHEAD + 2)))
    harness.want(1)
    first = harness.answer(1)
    assert first.lease is not None and not first.taken
    harness.settle()
    # The statement that served worker 1 also leased ahead in its name (and in worker 2's
    # name, which holds nothing yet, none), and sent them to it.
    one, two = harness.arbiter.children[1], harness.arbiter.children[2]
    named = worker_name(socket.gethostname(), os.getpid(), 1, 1)  # as the worker names itself
    assert [r.name for r in one.queued] == [named] * AHEAD and two.queued == []
    queued = list(harness.queue[1])
    assert [q.lease["id"] for q in queued] == [r.row["id"] for r in one.queued]
    assert all(q.until == q.since + dispatch_module.READY_FOR for q in queued)
    # Worker 1 finishes: it starts the first at once, with no answer to wait for, and the
    # supervisor records the step it finished with its next statement.
    started = harness.took(1, harness.finished(first, "one"))
    assert one.lease.step_id == started.lease["id"] == queued[0].lease["id"]
    assert [r.row["id"] for r in one.queued[: AHEAD - 1]] == [q.lease["id"] for q in queued[1:]]
    assert harness.dispatcher.taken  # recorded by the next statement, not yet
    harness.settle()
    assert harness.arbiter.later == [(first.lease["id"], "completed")]
    assert harness.env.client.get_run(runs[0]).output == {"only": "one"}
    assert harness.states([started.lease["id"]]) == [("running", 1)]


def serve_one(harness) -> tuple[Any, Any]:
    """Worker 1 served its first step, with AHEAD leases queued in its name: (the answer to
    its want, its handle)."""
    harness.env.client.submit_many(quick, list(range(AHEAD + 2)))
    harness.want(1)
    first = harness.answer(1)
    harness.settle()
    return first, harness.arbiter.children[1]


def test_a_want_that_crossed_its_queued_leases_is_answered_with_the_first(harness) -> None:
    first, one = serve_one(harness)
    ids = [r.row["id"] for r in one.queued]
    # Its want was written before their lines came: answered before any statement ran.
    harness.want(1, harness.finished(first, "one"))
    second = harness.answer(1, timeout=0.05)
    assert second.taken and second.recorded is None and second.lease["id"] == ids[0]
    assert second.since is not None and second.since <= time.monotonic()
    assert one.lease.step_id == ids[0]
    assert [r.row["id"] for r in one.queued] == ids[1:]
    assert [q.lease["id"] for q in harness.queue[1]] == ids[1:]  # it dropped it from its queue
    harness.settle()
    assert harness.arbiter.later == [(first.lease["id"], "completed")]


def test_a_queued_lease_that_no_worker_started_in_time_is_given_back(
    harness, monkeypatch
) -> None:
    _, one = serve_one(harness)
    ahead = [r.row["id"] for r in one.queued]
    assert len(ahead) == AHEAD
    monkeypatch.setattr(dispatch_module, "READY_FOR", 0.0)
    harness.dispatcher.expiry = 0.0  # their time came
    harness.dispatcher.flush(harness.arbiter)
    assert one.queued == []
    # Given back by a statement of its own, on a free session, without waiting for it.
    assert [r.row["id"] for s in harness.dispatcher.sessions for r in s.releasing] == ahead
    harness.settle()
    # Back in the queue, their attempts not spent.
    assert harness.states(ahead) == [("available", 0)] * AHEAD


def test_a_queued_lease_its_worker_started_in_time_is_never_given_back(
    harness, monkeypatch
) -> None:
    """The worker's `took` line is in the channel, unread, as the lease's time passes: the
    supervisor reads its worker's lines before it gives any back."""
    first, one = serve_one(harness)
    ahead = [r.row["id"] for r in one.queued]
    started = harness.took(1, harness.finished(first, "one"), read=False)
    monkeypatch.setattr(dispatch_module, "READY_FOR", 0.0)
    harness.dispatcher.expiry = 0.0
    harness.dispatcher.flush(harness.arbiter)
    assert one.lease.step_id == started.lease["id"] == ahead[0]
    assert one.queued == []
    assert [r.row["id"] for s in harness.dispatcher.sessions for r in s.releasing] == ahead[1:]
    harness.settle()
    assert harness.states(ahead) == [("running", 1)] + [("available", 0)] * (AHEAD - 1)
    assert harness.arbiter.later == [(first.lease["id"], "completed")]


def test_a_queued_lease_goes_back_once_it_waited_5_percent_of_its_steps_time(
    harness,
) -> None:
    first, one = serve_one(harness)
    ahead = [r.row["id"] for r in one.queued]
    assert len(ahead) == AHEAD
    for r in one.queued:
        # Steps of a second: after 60 ms (well within READY_FOR) a queued lease has spent
        # 6% of its step's time waiting; started, it would be killed that much early.
        r.row["kill_after"] = 1.0
        r.sent -= 0.06
    harness.dispatcher.expiry = 0.0
    harness.dispatcher.flush(harness.arbiter)
    assert one.queued == []
    assert [r.row["id"] for s in harness.dispatcher.sessions for r in s.releasing] == ahead
    harness.settle()
    assert harness.states(ahead) == [("available", 0)] * AHEAD
    assert harness.states([first.lease["id"]]) == [("running", 1)]


def test_leases_taken_ahead_under_an_old_config_go_back(harness) -> None:
    """After a reload the new workers may not serve the workflows of the old config, and the
    old ones leave: nothing taken under the old one is queued."""
    harness.env.client.submit_many(quick, list(range(AHEAD + 2)))
    harness.want(1)
    harness.dispatcher.flush(harness.arbiter)  # the statement is sent
    harness.arbiter.generation += 1  # SIGHUP, as it runs
    first = harness.answer(1)
    harness.settle()
    assert harness.arbiter.children[1].queued == [] and harness.queue[1] == []
    steps = harness.steps()
    assert sorted((s["state"], s["attempt"]) for s in steps) == [("available", 0)] * (
        AHEAD + 1
    ) + [("running", 1)]
    assert harness.states([first.lease["id"]]) == [("running", 1)]


def test_no_lease_is_taken_ahead_for_long_steps_or_while_draining(harness) -> None:
    harness.env.client.submit_many(quick, list(range(6)))
    harness.dispatcher.duration = 1.0  # steps of a second on average: none ahead
    harness.want(1)
    harness.answer(1)
    harness.settle()
    assert all(h.queued == [] for h in harness.arbiter.children.values())
    harness.dispatcher.duration = 0.0
    harness.arbiter.draining = True
    harness.arbiter.children[2].lease = None
    harness.want(2)
    assert harness.answer(2).lease is None
    harness.settle()
    assert all(h.queued == [] for h in harness.arbiter.children.values())


def test_fewer_leases_are_queued_as_the_steps_are_longer(harness) -> None:
    """A worker's queue holds at most AHEAD_FOR of work at the average step's length: with
    steps of about 16 ms, 7 leases (0.125 s), not AHEAD, whose last would wait longer."""
    harness.env.client.submit_many(quick, list(range(AHEAD + 2)))
    harness.dispatcher.duration = 0.0195  # and the want's 1 ms step: 0.0158 on average
    harness.want(1)
    harness.answer(1)
    harness.settle()
    assert harness.dispatcher.duration == pytest.approx(0.0158)
    assert len(harness.arbiter.children[1].queued) == 7 < AHEAD


def test_the_leases_queued_for_a_worker_gone_go_back(env: TestEnv) -> None:
    env.register(quick)
    h = Harness(env, workers=1)
    try:
        env.client.submit_many(quick, list(range(AHEAD + 2)))
        h.want(1)
        served = h.answer(1)
        h.settle()
        one = h.arbiter.children[1]
        assert len(one.queued) == AHEAD
        # The arbiter reaped the worker and read its last lines: the rest go back.
        h.dispatcher.release_later(one.queued)
        one.queued = []
    finally:
        h.close()
    states = {s["id"]: (s["state"], s["attempt"]) for s in h.steps()}
    assert states.pop(served.lease["id"]) == ("running", 1)
    assert sorted(states.values()) == [("available", 0)] * (AHEAD + 1)


def test_a_revoked_queued_lease_is_dropped_by_its_worker(harness) -> None:
    _, one = serve_one(harness)
    ready = one.queued[1]
    harness.dispatcher.revoked(one, ready)
    harness.read(1)
    assert [(d.step_id, d.token) for d in harness.dropped[1]] == [ready.key]
    assert ready in one.queued and ready.revoked  # until its time passes (or it starts)


def test_a_finished_step_whose_statement_failed_goes_with_the_next(harness) -> None:
    runs = harness.env.client.submit_many(quick, list(range(AHEAD + 2)))
    harness.want(1)
    first = harness.answer(1)
    harness.settle()
    harness.took(1, harness.finished(first, "kept"))
    assert harness.dispatcher.taken
    # The session dies under the statement that would record it.
    for session in harness.dispatcher.sessions:
        session.conn.pgconn.finish()
    harness.dispatcher.own_until = 0.0
    deadline = time.monotonic() + 10
    while harness.dispatcher.taken or any(s.busy for s in harness.dispatcher.sessions):
        assert time.monotonic() < deadline
        harness.dispatcher.flush(harness.arbiter)
        harness.pump(0.01)
        harness.dispatcher.own_until = 0.0  # the test does not wait out the pause
    assert harness.arbiter.later == [(first.lease["id"], "completed")]
    assert harness.env.client.get_run(runs[0]).output == {"only": "kept"}


def test_the_loop_wakes_for_the_linger_the_pause_an_expiry_or_an_answer_never_a_time_past(
    harness,
) -> None:
    first, _ = serve_one(harness)
    d = harness.dispatcher
    # Queued leases only: the loop wakes as the first may be given back.
    assert d.next_at() == d.expiry + dispatch_module.EXPIRY_SLACK
    assert d.expiry == min(r.until for r in harness.arbiter.children[1].queued)
    harness.took(1, harness.finished(first, "one"))
    assert d.next_at() == d.first_at + dispatch_module.TAKEN_LINGER  # no worker waits
    d.own_until = time.monotonic() + 5  # workers lease on their own: nothing to send till then
    assert d.next_at() == min(d.own_until, d.expiry + dispatch_module.EXPIRY_SLACK)
    d.own_until = 0.0
    busy = [s for s in d.sessions if not s.busy]
    for s in busy:
        s.batch = []  # every session with a statement in flight: its answer wakes the loop
    d.size = len(d.sessions)
    assert d.next_at() == d.expiry + dispatch_module.EXPIRY_SLACK  # that needs no session
    for s in busy:
        s.batch = None
    harness.settle()
    assert harness.arbiter.later == [(first.lease["id"], "completed")]


mails = cyclone.Workflow("dispatch-mails", queue="emails")


@mails.task()
def mail(ctx):
    return None


def test_a_capped_queue_holds_at_most_its_cap_of_the_vms_workers(
    env: TestEnv, monkeypatch: pytest.MonkeyPatch
):
    """[supervisor] queues = { default = 4, emails = 1 }: however many workers ask at once,
    one holds an emails step; the others take the default queue's. A statement that may take
    a capped queue's step takes no lease ahead (which no cap could count)."""
    # Every statement looks from the start: where a session's lease starts is not under test.
    monkeypatch.setattr(engine_steps, "FULL_SCAN_EVERY", 0.0)
    env.register(quick, mails)
    env.client.submit_many(mails, [None] * 6)
    env.client.submit_many(quick, [None] * 6)
    h = Harness(
        env, 4, workflows=lambda: (quick.name, mails.name), caps=lambda: {"emails": 1},
        queue_of=lambda wf: "emails" if wf == mails.name else "default",
    )  # fmt: skip
    try:
        _cap_rounds(h)
    finally:
        h.close()


def _cap_rounds(h: Harness) -> None:
    h.dispatcher.duration = 0.0
    held: dict[int, str] = {}
    for _ in range(3):  # a few rounds: the cap holds across statements
        for pid in h.arbiter.children:
            if pid not in held:
                h.want(pid)
        for pid in list(h.arbiter.children):
            if pid in held:
                continue
            given = h.answer(pid)
            if given.lease is not None:
                held[pid] = given.lease["workflow"]
        ahead = [r.row["workflow"] for c in h.arbiter.children.values() for r in c.queued]
        assert list(held.values()).count(mails.name) + ahead.count(mails.name) <= 1, held
    assert list(held.values()).count(mails.name) == 1
    assert len(held) == 4  # the capped queue's spare does not hold back the default queue
    # The mail's worker finishes, and asks again until the queue's slot is given again
    # (leases taken ahead for the default queue go first).
    [pid] = [p for p, wf in held.items() if wf == mails.name]
    for _ in range(8):
        h.arbiter.children[pid].lease = None
        h.want(pid)
        given = h.answer(pid)
        if given.lease is not None and given.lease["workflow"] == mails.name:
            break
    else:
        raise AssertionError("the emails queue's slot was never given again")
    h.settle()


limited = cyclone.Workflow("dispatch-ahead-limited")


@limited.task(concurrency=16)
def capped(ctx):
    return ctx.input


def test_fewer_leases_are_queued_while_the_steps_leased_are_of_a_node_limit(env) -> None:
    """Leases queued count against a node's `concurrency`: once the steps leased are seen to
    be of a node limited to 16, two workers are leased 8 ahead each at most (LIMITED_SHARE),
    not AHEAD; once they are of no limit, AHEAD again."""
    assert dispatch_module.limited_depth(16, 2) == 8 < AHEAD
    harness = Harness(env, workers=2, workflows=lambda: (limited.name, quick.name))
    one, two = harness.arbiter.children[1], harness.arbiter.children[2]
    try:
        env.client.submit_many(limited, list(range(AHEAD + 1)))
        harness.want(1)
        harness.answer(1)
        harness.settle()
        # The first statement knew of no limit: AHEAD queued for worker 1, every limited step.
        assert len(one.queued) == AHEAD
        assert harness.dispatcher.node_limit == 16
        env.client.submit_many(quick, list(range(30)))
        harness.want(2)
        first = harness.answer(2)
        harness.settle()
        assert first.lease["workflow"] == quick.name
        assert len(two.queued) == 8
        # Those were of no limit: the statement that records worker 2's step refills its
        # queue to AHEAD.
        assert harness.dispatcher.node_limit is None
        harness.took(2, harness.finished(first, "two"))
        harness.settle()
        assert len(two.queued) == AHEAD
    finally:
        harness.close()


def test_a_supervisor_whose_graphs_limit_no_node_leases_none_of_a_limited_nodes_steps(
    env,
) -> None:
    """With `limited` false (Served.limited: no graph it serves limits a node) the dispatcher
    sends steps_dispatch_plain, which leaves out the steps of limited nodes; with it true, the
    statement that takes them, and each lease's slot travels with the step finished."""
    plain = Harness(env, workers=1, workflows=lambda: (limited.name, quick.name),
                    limited=lambda: False)  # fmt: skip
    try:
        env.client.submit_many(limited, [0, 1])
        env.client.submit(quick, 0)
        plain.want(1)
        first = plain.answer(1)
        plain.settle()
        assert first.lease["workflow"] == quick.name and first.lease["slot"] is None
        assert plain.arbiter.children[1].queued == []
    finally:
        plain.close()
    both = Harness(env, workers=1, workflows=lambda: (limited.name, quick.name))
    try:
        both.want(1)
        given = both.answer(1)
        assert given.lease["workflow"] == limited.name and given.lease["slot"] is not None
        finished = both.finished(given, "done")
        assert finished["slot"] == given.lease["slot"]
        both.settle()
        both.dispatcher.want(
            both.arbiter.children[1], channel.Want(lease=False, duration=0.001, finished=finished)
        )
        both.settle()
        held = env.conn.execute(
            "SELECT count(*) AS n FROM cyclone_node_slots WHERE step_id = %s", (given.lease["id"],)
        ).fetchone()
        assert held["n"] == 0
        assert env.conn.execute(
            "SELECT state FROM cyclone_steps WHERE id = %s", (given.lease["id"],)
        ).fetchone()["state"] == "completed"
    finally:
        both.close()

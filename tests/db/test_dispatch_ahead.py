"""Leases taken ahead: the supervisor answers a worker that finished a short step at once, and
records the step with the next statement; a lease no worker took in time is given back."""

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


@dataclass
class Arbiter:
    """What the dispatcher asks of the arbiter, recording what it is told."""

    children: dict[int, Handle] = field(default_factory=dict)
    draining: bool = False
    generation: int = 0
    later: list[tuple[int, str]] = field(default_factory=list)

    def may_lease(self, handle: Handle, finishing: int | None = None) -> bool:
        held = handle.lease
        return not self.draining and (held is None or held.step_id == finishing)

    def on_message(self, handle: Handle, message: channel.Message) -> None:
        if isinstance(message, channel.Leased):
            handle.lease = held_lease(message, time.monotonic())
        elif isinstance(message, channel.Done):
            handle.lease = None

    def handed_over(self, handle: Handle, leased: channel.Leased) -> Any:
        finished = handle.lease
        self.on_message(handle, leased)
        return finished

    def step_finished(self, lease: Any, done: channel.Done) -> None:
        assert lease.step_id == done.step_id
        self.later.append((done.step_id, done.outcome))


class Harness:
    def __init__(self, env: TestEnv, workers: int, **options: Any) -> None:
        self.env = env
        self.arbiter = Arbiter()
        options.setdefault("workflows", lambda: (quick.name,))
        self.dispatcher = Dispatcher(env.dsn, lease_ttl=30.0, **options)
        self.dispatcher.duration = 0.0  # the steps are short: it leases ahead
        self._keep: list[socket.socket] = []
        for pid in range(1, workers + 1):
            ours, theirs = socket.socketpair()
            ours.setblocking(False)
            self.arbiter.children[pid] = Handle(pid, ours.fileno(), theirs)
            self._keep.append(ours)

    def want(self, pid: int, finished: Any = None) -> None:
        handle = self.arbiter.children[pid]
        message = channel.Want(lease=True, duration=0.001, finished=finished)
        self.dispatcher.want(handle, message)

    def answer(self, pid: int, timeout: float = 10.0) -> channel.Given:
        """Run the loop until this worker's answer arrives, and read it."""
        peer = self.arbiter.children[pid].peer
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.dispatcher.flush(self.arbiter)
            if select.select([peer], [], [], 0)[0]:
                message = channel.decode(peer.recv(1 << 16))
                assert isinstance(message, channel.Given)
                return message
            self.pump(0.01)
        raise AssertionError(f"no answer for worker {pid}")

    def pump(self, timeout: float) -> None:
        fds = [s.fileno() for s in self.dispatcher.sessions if s.busy]
        ready = select.select(fds, [], [], timeout)[0] if fds else []
        for fd in ready:
            self.dispatcher.on_readable(fd, self.arbiter)

    def settle(self, timeout: float = 10.0) -> None:
        """Until nothing is waiting or in flight."""
        deadline = time.monotonic() + timeout
        d = self.dispatcher
        while d.pending or d.taken or d.stale or any(s.busy for s in d.sessions):
            assert time.monotonic() < deadline, "the dispatcher never settled"
            d.flush(self.arbiter)
            self.pump(0.01)

    def finished(self, given: channel.Given, output: Any) -> dict[str, Any]:
        lease = lease_of(given.lease, 30.0)
        text = finished_json(self.env.conn, lease, json.dumps(output))
        assert text is not None
        return json.loads(text)

    def steps(self) -> list[dict[str, Any]]:
        return self.env.conn.execute(
            "SELECT id, state, attempt, leased_by FROM cyclone_steps ORDER BY id"
        ).fetchall()

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


def test_a_worker_that_finished_is_answered_from_the_leases_taken_ahead(harness) -> None:
    runs = harness.env.client.submit_many(quick, list(range(8)))
    harness.want(1)
    first = harness.answer(1)
    assert first.lease is not None and not first.taken
    harness.settle()
    # The statement that served worker 1 also leased ahead in its name (and in worker 2's
    # name, which holds nothing yet, none).
    named = worker_name(socket.gethostname(), os.getpid(), 1, 1)  # as the worker names itself
    assert [r.name for r in harness.dispatcher.ready] == [named] * AHEAD
    # Worker 1 finishes: its answer comes before any statement ran, from those leases.
    harness.want(1, harness.finished(first, "one"))
    second = harness.answer(1, timeout=0.05)
    assert second.taken and second.recorded is None and second.lease is not None
    assert second.since is not None and second.since <= time.monotonic()
    assert harness.dispatcher.taken  # recorded by the next statement, not yet
    harness.settle()
    assert harness.arbiter.later == [(first.lease["id"], "completed")]
    assert harness.env.client.get_run(runs[0]).output == {"only": "one"}
    steps = {s["id"]: s for s in harness.steps()}
    assert steps[second.lease["id"]]["state"] == "running"
    assert steps[second.lease["id"]]["attempt"] == 1


def test_a_lease_taken_ahead_that_no_worker_takes_in_time_is_given_back(
    harness, monkeypatch
) -> None:
    harness.env.client.submit_many(quick, list(range(AHEAD + 2)))
    harness.want(1)
    harness.answer(1)
    harness.settle()
    ahead = [r.row["id"] for r in harness.dispatcher.ready]
    assert len(ahead) == AHEAD
    monkeypatch.setattr(dispatch_module, "READY_FOR", 0.0)
    harness.dispatcher.flush(harness.arbiter)
    assert harness.dispatcher.ready == []
    # Given back by a statement of its own, on a free session, without waiting for it.
    assert [r.row["id"] for s in harness.dispatcher.sessions for r in s.releasing] == ahead
    harness.settle()
    steps = {s["id"]: s for s in harness.steps()}
    # Back in the queue, their attempts not spent.
    assert [(steps[i]["state"], steps[i]["attempt"]) for i in ahead] == [("available", 0)] * AHEAD


def test_a_lease_taken_ahead_goes_back_once_it_waited_5_percent_of_its_steps_time(
    harness,
) -> None:
    harness.env.client.submit_many(quick, list(range(AHEAD + 2)))
    harness.want(1)
    first = harness.answer(1)
    harness.settle()
    ahead = [r.row["id"] for r in harness.dispatcher.ready]
    assert len(ahead) == AHEAD
    for r in harness.dispatcher.ready:
        # Steps of a second: after 60 ms (well within READY_FOR) a lease held ready has
        # spent 6% of its step's time waiting; handed on, it would be killed that much early.
        r.row["kill_after"] = 1.0
        r.sent -= 0.06
    harness.dispatcher.flush(harness.arbiter)
    assert harness.dispatcher.ready == []
    assert [r.row["id"] for s in harness.dispatcher.sessions for r in s.releasing] == ahead
    harness.settle()
    steps = {s["id"]: s for s in harness.steps()}
    assert [(steps[i]["state"], steps[i]["attempt"]) for i in ahead] == [("available", 0)] * AHEAD
    assert steps[first.lease["id"]]["state"] == "running"


def test_leases_taken_ahead_under_an_old_config_go_back(harness) -> None:
    """After a reload the new workers may not serve the workflows of the old config."""
    harness.env.client.submit_many(quick, list(range(AHEAD + 2)))
    harness.want(1)
    first = harness.answer(1)
    harness.settle()
    ahead = [r.row["id"] for r in harness.dispatcher.ready]
    tokens = {r.row["lease_token"] for r in harness.dispatcher.ready}
    assert len(ahead) == AHEAD
    harness.arbiter.generation += 1  # SIGHUP: workers of the new config
    harness.arbiter.children[2].lease = None
    harness.want(2)
    given = harness.answer(2)
    harness.settle()
    # Worker 2 got a step leased for it, not one of those leases; they went back, their
    # attempts not spent. A step given back keeps its place in the line, so the new config's
    # statements may have leased it again since, for worker 2 or ahead: under a new lease.
    assert not given.taken and given.lease["lease_token"] not in tokens
    assert all(r.generation == 1 for r in harness.dispatcher.ready)
    again = {r.row["id"] for r in harness.dispatcher.ready} | {given.lease["id"]}
    steps = {s["id"]: s for s in harness.steps()}
    expected = {i: ("running", 1) if i in again else ("available", 0) for i in ahead}
    assert {i: (steps[i]["state"], steps[i]["attempt"]) for i in ahead} == expected
    assert steps[first.lease["id"]]["state"] == "running"


def test_no_lease_is_taken_ahead_for_long_steps_or_while_draining(harness) -> None:
    harness.env.client.submit_many(quick, list(range(6)))
    harness.dispatcher.duration = 1.0  # steps of a second on average: none ahead
    harness.want(1)
    harness.answer(1)
    harness.settle()
    assert harness.dispatcher.ready == []
    harness.dispatcher.duration = 0.0
    harness.arbiter.draining = True
    harness.arbiter.children[2].lease = None
    harness.want(2)
    assert harness.answer(2).lease is None
    harness.settle()
    assert harness.dispatcher.ready == []


def test_closing_gives_the_leases_taken_ahead_back(env: TestEnv) -> None:
    env.register(quick)
    h = Harness(env, workers=1)
    try:
        env.client.submit_many(quick, list(range(AHEAD + 2)))
        h.want(1)
        served = h.answer(1)
        h.settle()
        assert len(h.dispatcher.ready) == AHEAD
    finally:
        h.close()
    states = {s["id"]: (s["state"], s["attempt"]) for s in h.steps()}
    assert states.pop(served.lease["id"]) == ("running", 1)
    assert sorted(states.values()) == [("available", 0)] * (AHEAD + 1)


def test_a_finished_step_whose_statement_failed_goes_with_the_next(harness) -> None:
    runs = harness.env.client.submit_many(quick, list(range(6)))
    harness.want(1)
    first = harness.answer(1)
    harness.settle()
    harness.want(1, harness.finished(first, "kept"))
    assert harness.answer(1, timeout=0.05).taken
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


def test_the_loop_wakes_for_the_linger_the_pause_or_an_answer_never_a_time_past(
    harness,
) -> None:
    harness.env.client.submit_many(quick, list(range(AHEAD + 2)))
    harness.want(1)
    first = harness.answer(1)
    harness.settle()
    harness.want(1, harness.finished(first, "one"))
    assert harness.answer(1, timeout=0.05).taken
    d = harness.dispatcher
    assert d.next_at() == d.first_at + dispatch_module.LINGER
    d.own_until = time.monotonic() + 5  # workers lease on their own: nothing to send till then
    assert d.next_at() == d.own_until
    d.own_until = 0.0
    busy = [s for s in d.sessions if not s.busy]
    for s in busy:
        s.batch = []  # every session with a statement in flight: its answer wakes the loop
    d.size = len(d.sessions)
    assert d.next_at() is None
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
        ahead = [r.row["workflow"] for r in h.dispatcher.ready]
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

"""What a worker writes is not trusted: any line costs the supervisor nothing but that worker.

Issue 22, item 5: lines with fields of the wrong type crashed the supervisor, a flood of lines
held its loop, and a forged `idle` switched a step's timeout off. The arbiter here runs on the
fakes (tests/fakes.py); the lines go through the real decoder.
"""

from __future__ import annotations

import json
import math
import signal
from dataclasses import fields

import pytest
from fakes import Harness, tok
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cyclone.child import channel
from cyclone.supervisor.arbiter import FLOOD_LINES, READ_BUDGET
from cyclone.supervisor.children import KillReason

VERBS = ["ready", "leased", "done", "idle", "scanned", "want", "given", "beat", "bogus"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip
FIELD_NAMES = sorted({f.name for cls in channel._KINDS for f in fields(cls)})
bodies = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), json_values,
                         max_size=8)  # fmt: skip


def _fresh() -> tuple[Harness, int]:
    h = Harness()
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    return h, pid


def _feed(h: Harness, pid: int, line: bytes) -> None:
    handle = h.arbiter.children[pid]
    h.ops.pipes[handle.fd].append(line + b"\n")
    h.arbiter.on_readable(handle.fd)
    h.arbiter.tick()


def _checked(message: channel.Message) -> None:
    """Every field of a decoded message holds what it is read as."""
    for name, kind in channel._KINDS[type(message)].items():
        assert kind(getattr(message, name)), (name, getattr(message, name))


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | st.sampled_from(VERBS).flatmap(
    lambda verb: bodies.map(lambda b: f"{verb} {json.dumps(b)}".encode())
))  # fmt: skip
def test_any_line_decodes_to_a_checked_message_or_is_a_protocol_error(line: bytes) -> None:
    try:
        message = channel.decode(line)
    except channel.ProtocolError:
        return
    _checked(message)


@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200) | st.sampled_from(VERBS).flatmap(
    lambda verb: bodies.map(lambda b: f"{verb} {json.dumps(b)}".encode())
))  # fmt: skip
def test_the_supervisor_survives_any_line_and_kills_a_worker_whose_line_is_no_message(
    line: bytes,
) -> None:
    h, pid = _fresh()
    line = line.replace(b"\n", b" ")
    try:
        # A `given` is the supervisor's answer: from a worker, it is no message either.
        valid = bool(line.strip()) and not isinstance(channel.decode(line), channel.Given)
    except channel.ProtocolError:
        valid = False
    _feed(h, pid, line)  # must not raise, whatever the line
    handle = h.arbiter.children.get(pid)
    if not valid and line.strip():
        assert handle.kill is not None and handle.kill.reason is KillReason.BAD_MESSAGE
        assert h.ops.signals_to(pid)[-1] == ("pid", signal.SIGKILL)
    other = next(p for p in h.workers() if p != pid)
    assert h.arbiter.children[other].kill is None  # the other worker pays nothing


@pytest.mark.parametrize("line", [
    b'leased {"step_id": "7", "token": "t", "run_id": "r", "workflow": "w", "node": "n",'
    b' "attempt": 1, "kill_after": 1.0, "deadline_left": null}',
    b'leased {"step_id": 7, "token": "t", "run_id": "r", "workflow": "w", "node": "n",'
    b' "attempt": 1, "kill_after": NaN, "deadline_left": null}',
    # A token the renewal and revocation statements could not cast would fail them for every
    # worker of the VM: it fails only its sender.
    b'leased {"step_id": 7, "token": "x}{", "run_id": "r", "workflow": "w", "node": "n",'
    b' "attempt": 1, "kill_after": 1.0, "deadline_left": null}',
    b'want {"lease": 1}',
    b'want {"lease": true, "finished": {"step_id": 7}}',
    b'beat {"step_id": [], "since": "x"}',
    b'done {"step_id": 7, "outcome": "completed", "duration": Infinity}',
    b'scanned {"at": 1.0, "ok": true, "counts": {"x": "1"}}',
    b"[" * 5000,
    b"want " + b'{"finished": ' * 2000,
])  # fmt: skip
def test_fields_of_the_wrong_type_cost_the_sender_its_life_and_nobody_else_anything(
    line: bytes,
) -> None:
    h, pid = _fresh()
    _feed(h, pid, line)
    assert h.arbiter.children[pid].kill.reason is KillReason.BAD_MESSAGE
    assert math.isclose(h.arbiter.children[pid].kill.hard_at, h.clock())  # no grace


def test_a_forged_idle_or_done_does_not_switch_a_steps_timeout_off() -> None:
    h = Harness()
    pid = h.started()[0]
    h.lease(pid, kill_after=2.0)
    wrong = tok(8).encode()  # well formed, not this lease's
    for forged in (b"idle", b'idle {"step_id": 7}', b'idle {"step_id": 7, "token": "%s"}' % wrong,
                   b'done {"step_id": 7, "outcome": "completed", "duration": 0.1}'):  # fmt: skip
        _feed(h, pid, forged)
    assert h.arbiter.children[pid].lease is not None
    h.clock.advance(2.0)
    h.arbiter.tick()
    assert h.arbiter.children[pid].kill.reason is KillReason.TIMEOUT
    # The real report, naming the step and its token, does end the watch.
    h2 = Harness()
    pid2 = h2.started()[0]
    h2.lease(pid2, kill_after=2.0)
    _feed(h2, pid2, b'idle {"step_id": 7, "token": "%s"}' % tok(7).encode())
    assert h2.arbiter.children[pid2].lease is None


def test_a_pass_of_the_loop_reads_a_budget_of_a_workers_channel_no_more() -> None:
    h, pid = _fresh()
    handle = h.arbiter.children[pid]
    # Long lines, each a message, few enough not to be a flood: 6 MB waiting.
    line = channel.encode(channel.Done(7, "failed", 0.1, error="x" * 60_000, token=tok(7)))
    h.ops.pipes[handle.fd] = [line] * 100
    h.arbiter.on_readable(handle.fd)
    read = 100 - len(h.ops.pipes[handle.fd])
    assert 0 < read * len(line) <= READ_BUDGET + len(line)
    assert handle.kill is None


def test_a_flooding_worker_is_killed_and_not_read_any_more() -> None:
    h, pid = _fresh()
    handle = h.arbiter.children[pid]
    chunk = b"ready\n" * 10_000
    h.ops.pipes[handle.fd] = [chunk] * 100
    for _ in range(FLOOD_LINES // 10_000 + 1):
        h.arbiter.on_readable(handle.fd)
    assert handle.kill.reason is KillReason.BAD_MESSAGE and handle.deaf
    left = len(h.ops.pipes[handle.fd])
    h.arbiter.on_readable(handle.fd)
    assert len(h.ops.pipes[handle.fd]) == left  # not read any more


def test_a_line_over_the_limit_is_a_bad_message() -> None:
    h, pid = _fresh()
    _feed(h, pid, b"x" * (channel.MAX_LINE + 1))
    assert h.arbiter.children[pid].kill.reason is KillReason.BAD_MESSAGE

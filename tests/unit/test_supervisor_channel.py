"""The worker-to-supervisor pipe protocol, exit statuses and process titles."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import asdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cyclone.child import channel
from cyclone.child.proctitle import scanner_title, supervisor_title, worker_title
from cyclone.supervisor.children import ExitStatus

LEASED = channel.Leased(
    step_id=7, token="0b6f2c5e-1111-2222-3333-444455556666", run_id="9c1d",
    workflow="fulfill order", node="reserve", attempt=2, kill_after=29.5, deadline_left=None,
)  # fmt: skip


@pytest.mark.parametrize(
    "message",
    [
        channel.Ready(),
        LEASED,
        channel.Done(step_id=7, outcome="completed", duration=0.25),
        channel.Idle(),
        channel.Exit(code=4),
    ],
)
def test_every_message_survives_a_round_trip_as_one_line(message: channel.Message) -> None:
    raw = channel.encode(message)
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert channel.decode(raw) == message


def _generic(message: channel.Message) -> bytes:
    body = json.dumps(asdict(message), separators=(",", ":"))
    return f"{message.verb} {body}\n".encode()


texts = st.text() | st.uuids().map(str) | st.sampled_from(["completed", "a b", "\\", '"'])
numbers = st.none() | st.floats() | st.integers(-(2**40), 2**40).map(float)
ints = st.integers(0, 2**63 - 1)


@given(
    st.builds(channel.Leased, step_id=ints, token=texts, run_id=texts, workflow=texts,
              node=texts, attempt=ints, kill_after=numbers, deadline_left=numbers,
              since=numbers)
    | st.builds(channel.Done, step_id=ints, outcome=texts, duration=numbers,
                error=st.none() | texts, retry=st.none() | st.booleans())
)  # fmt: skip
def test_the_per_step_messages_encode_as_the_generic_json_would(message) -> None:
    # leased and done lines are written by hand, for speed: byte for byte what json would write.
    assert type(message) in channel._FAST
    assert channel.encode(message) == _generic(message)


def test_a_bare_verb_has_no_payload() -> None:
    assert channel.encode(channel.Ready()) == b"ready\n"


def test_a_worker_has_no_say_in_its_leases_renewal() -> None:
    # The supervisor renews the leases of the workers the OS vouches for: a worker's `beat`
    # line (which once renewed its lease in the supervisor's eyes) is no message any more.
    with pytest.raises(channel.ProtocolError):
        channel.decode(b'beat {"step_id": 7, "since": 1e300}')


@pytest.mark.parametrize("line", [b"hello", b"leased {not json", b'done {"step_id": 1}', b""])
def test_garbage_lines_are_protocol_errors(line: bytes) -> None:
    with pytest.raises(channel.ProtocolError):
        channel.decode(line)


def test_unknown_fields_from_a_newer_worker_are_ignored() -> None:
    assert channel.decode(b'done {"step_id":1,"outcome":"x","duration":1,"extra":2}') == (
        channel.Done(step_id=1, outcome="x", duration=1)
    )


def test_the_line_buffer_hands_out_whole_lines_only() -> None:
    buffer = channel.LineBuffer()
    assert buffer.feed(b"ready\nid") == [b"ready"]
    assert buffer.feed(b"le\n") == [b"idle"]
    assert buffer.feed(b"idle") == []
    assert buffer.feed(b"\n\n") == [b"idle"]


def test_the_line_buffer_drops_overlong_lines() -> None:
    buffer = channel.LineBuffer()
    assert buffer.feed(b"x" * (channel.MAX_LINE + 1)) == []
    assert buffer.feed(b"\nbeat\n") == [b"beat"]


def test_a_message_too_long_for_an_atomic_write_is_refused() -> None:
    with pytest.raises(channel.ProtocolError):
        channel.encode(channel.Done(step_id=1, outcome="x" * channel.MAX_LINE, duration=0))


def test_a_channel_writes_whole_lines_into_a_pipe() -> None:
    read_fd, write_fd = os.pipe()
    try:
        channel.Channel(write_fd).send(LEASED)
        assert channel.decode(os.read(read_fd, 65536)) == LEASED
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_channel_announces_its_childs_exit_and_never_waits_long_for_its_lock() -> None:
    read_fd, write_fd = os.pipe()
    try:
        ours = channel.Channel(write_fd)
        ours.say_exit(channel.ExitCode.LEASE_LOST)
        assert channel.decode(os.read(read_fd, 65536)) == channel.Exit(code=4)
        # The lock held (by the thread a signal interrupted, say): no line, no wait past `wait`.
        ours._lock.acquire()
        ours.say_exit(channel.ExitCode.CRASHED, wait=0.01)
        os.set_blocking(read_fd, False)
        with pytest.raises(BlockingIOError):
            os.read(read_fd, 65536)
    finally:
        os.close(read_fd)
        os.close(write_fd)


GIVEN = b'given {"recorded":true,"since":1.5}\n'


@pytest.mark.parametrize("kind", ["socket", "nonblocking socket", "pipe"])
def test_a_worker_waits_for_its_answer_as_long_as_told_and_reads_it_at_once(kind: str) -> None:
    """The worker's reads wait on the socket's own receive timeout (one system call a line):
    it gives up after `timeout` and not sooner, reads a line that comes, and takes an EOF for
    its supervisor gone. A pipe, or a socket that does not block, is waited on with select:
    without that a read would return at once and the caller spin."""
    if kind == "pipe":
        theirs_fd, ours_fd = os.pipe()
        write, close = (lambda data: os.write(ours_fd, data)), (lambda: os.close(ours_fd))
    else:
        sup, worker = socket.socketpair()
        theirs_fd = worker.fileno()
        if kind == "nonblocking socket":
            worker.setblocking(False)
        write, close = sup.sendall, sup.close
    ours = channel.Channel(theirs_fd)
    try:
        for timeout in (0.05, 0.1, 0.05):
            start = time.monotonic()
            assert ours.receive(timeout) is None
            assert timeout * 0.9 <= time.monotonic() - start < timeout + 0.5
        write(GIVEN + GIVEN[:10])
        assert ours.receive(5.0) == channel.Given(recorded=True, since=1.5)
        write(GIVEN[10:])
        assert ours.receive(5.0) == channel.Given(recorded=True, since=1.5)
        assert ours._timed is (kind == "socket")
        close()
        with pytest.raises(EOFError):
            ours.receive(5.0)
    finally:
        os.close(theirs_fd)
        if kind != "pipe":
            worker.detach()


def test_exit_statuses_are_decoded_with_the_wif_helpers() -> None:
    assert ExitStatus.decode(3 << 8) == ExitStatus(code=3)
    assert ExitStatus.decode(signal.SIGKILL) == ExitStatus(signal=signal.SIGKILL)
    assert ExitStatus(code=4).describe() == "exited with 4 (lease_lost)"
    assert ExitStatus(code=42).describe() == "exited with 42"
    assert ExitStatus(signal=signal.SIGKILL).describe() == "killed by SIGKILL"


def test_process_titles_read_as_the_spec_shows() -> None:
    assert supervisor_title() == "cyclone supervisor"
    assert scanner_title() == "cyclone scanner"
    assert worker_title(3) == "cyclone worker 3: idle"
    title = worker_title(3, workflow="fulfill-order", node="reserve", run_id="abc", attempt=2)
    assert title == "cyclone worker 3: fulfill-order/reserve run=abc attempt=2"

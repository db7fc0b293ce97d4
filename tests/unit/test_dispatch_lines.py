"""The `want` and `given` lines of the channel, as the worker and the supervisor write them."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cyclone.child import channel
from cyclone.engine.dispatch import lease_of
from cyclone.supervisor.dispatch import aged, given_line

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


def row(input, item) -> dict:
    return {
        "worker": 1, "id": 7, "available_at": "2026-12-01T10:00:00+00:00",
        "run_id": "0c6e1f43-5d0e-4c57-9a0e-8c3b5c2f8f11", "workflow": "w", "node": "n",
        "kind": "task", "item_index": None, "item": item, "attempt": 1, "max_attempts": 3,
        "lease_token": "5d2a5f0e-1111-4a57-9a0e-8c3b5c2f8f11", "input": input,
        "deadline_at": "2026-12-01T11:00:00+00:00", "graph_hash": "abc",
        "parent_run_id": None, "kill_after": 300.0, "deadline_left": 3600.0,
    }  # fmt: skip


@given(input=json_values, item=json_values)
def test_a_lease_crosses_the_channel_whole(input, item) -> None:
    line = given_line(True, row(input, item), 123.5)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    message = channel.decode(line)
    assert isinstance(message, channel.Given)
    assert (message.recorded, message.since, message.own) == (True, 123.5, False)
    lease = lease_of(message.lease, 30.0)
    assert (lease.input, lease.item, lease.step_id, lease.attempt) == (input, item, 7, 1)
    assert lease.deadline_at == datetime(2026, 12, 1, 11, tzinfo=UTC)


def test_an_answer_without_a_lease_says_what_became_of_the_finished_step() -> None:
    for recorded in (True, False, None):
        message = channel.decode(given_line(recorded, None, 1.0))
        assert isinstance(message, channel.Given)
        assert (message.recorded, message.lease) == (recorded, None)


def test_a_want_line_decodes_with_its_finished_task() -> None:
    token, run = "7a4c3c52-9d1e-4c4b-9c61-0a1b2c3d4e5f", "0d9f6a3e-1b2c-4d5e-8f90-a1b2c3d4e5f6"
    line = (
        b'want {"lease":true,"duration":0.25,"finished":{"step_id":7,"token":"%s",'
        b'"run_id":"%s","last":false,"next":[{"node":"b"}],"output":{"x":[1,2]}}}\n'
    ) % (token.encode(), run.encode())
    message = channel.decode(line)
    assert message == channel.Want(
        lease=True, duration=0.25,
        finished={"step_id": 7, "token": token, "run_id": run, "last": False,
                  "next": [{"node": "b"}], "output": {"x": [1, 2]}},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("slot", "good"), [(3, True), (None, True), (2**31 - 1, True), (0, False), (2**31, False),
                       (-1, False), ("3", False), (True, False), (1.5, False)],
)  # fmt: skip
def test_a_finished_tasks_slot_is_an_integer_slot_number_or_the_line_is_refused(
    slot, good
) -> None:
    """The slot a lease row named comes back with the task finished (migration 34); anything
    the statement's `integer` column could not take is refused with the line, which would
    otherwise fail the whole statement, every other worker's completions with it."""
    token, run = "7a4c3c52-9d1e-4c4b-9c61-0a1b2c3d4e5f", "0d9f6a3e-1b2c-4d5e-8f90-a1b2c3d4e5f6"
    finished = {"step_id": 7, "token": token, "run_id": run, "last": True, "next": None,
                "output": None, "slot": slot}  # fmt: skip
    line = b"want " + json.dumps({"lease": True, "finished": finished}).encode() + b"\n"
    if good:
        assert channel.decode(line) == channel.Want(lease=True, finished=finished)
    else:
        with pytest.raises(channel.ProtocolError, match="finished"):
            channel.decode(line)


times = st.floats(0.0, 1e6, allow_nan=False) | st.none()


@given(kill_after=times, deadline_left=times, age=st.floats(0.0, 0.25))
def test_a_lease_taken_ahead_keeps_its_runs_deadline_and_its_whole_timeout(
    kill_after, deadline_left, age
) -> None:
    """Handed on `age` seconds after it was taken: the time left to the run's deadline shrinks
    by the wait, and so does the kill when the deadline is what kills; a timeout does not."""
    if kill_after is not None and deadline_left is not None:
        kill_after = min(kill_after, deadline_left)  # as the statement computes it
    before = {**row(None, None), "kill_after": kill_after, "deadline_left": deadline_left}
    after = aged(before, age)
    if deadline_left is None:
        assert after == before
        return
    assert after["deadline_left"] == deadline_left - age
    if kill_after is not None and kill_after >= deadline_left:
        assert after["kill_after"] == kill_after - age
    else:
        assert after["kill_after"] == kill_after
    assert {k: v for k, v in after.items() if k not in ("kill_after", "deadline_left")} == {
        k: v for k, v in before.items() if k not in ("kill_after", "deadline_left")
    }

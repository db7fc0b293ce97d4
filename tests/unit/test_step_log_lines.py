"""The supervisor's step lines (issue 27, items 2 and 4): whole run ids; a map item names its
index; a map's evaluating row is not one more completed step; JSON lines carry the step's
fields; and the arbiter tells a Traces port of each attempt's start, end and kills."""

from __future__ import annotations

import json
import logging
import signal
from types import SimpleNamespace

from fakes import Harness, tok

from cyclone.child import channel
from cyclone.logs import JsonFormatter, StepFields
from cyclone.supervisor.children import ExitStatus

RUN = "6836074d-5c47-4dd5-88cf-1b07d1b31377"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, *args))


def leased(step_id: int, item: int | None = None, kill_after: float | None = 2.0):
    return channel.Leased(
        step_id=step_id, token=tok(step_id), run_id=RUN, workflow="wf", node="each",
        attempt=1, kill_after=kill_after, deadline_left=None, item=item,
    )  # fmt: skip


def done(step_id: int, outcome: str) -> channel.Done:
    return channel.Done(step_id=step_id, outcome=outcome, duration=0.01, token=tok(step_id))


def booted(h: Harness) -> int:
    h.arbiter.start()
    pid = h.workers()[0]
    h.boot(pid)
    return pid


def test_item_lines_name_their_index_and_the_whole_run_id(h: Harness, caplog) -> None:
    pid = booted(h)
    caplog.set_level(logging.INFO)
    h.send(pid, leased(8, item=3))
    h.send(pid, done(8, "completed"))
    assert f"step wf/each[3] run={RUN} attempt=1 completed in" in caplog.text
    (record,) = [r for r in caplog.records if "completed in" in r.getMessage()]
    line = json.loads(JsonFormatter().format(record))
    assert line["run_id"] == RUN and line["step_id"] == 8 and line["item"] == 3
    assert (line["workflow"], line["node"], line["attempt"]) == ("wf", "each", 1)


def test_a_maps_evaluating_row_is_no_step_of_its_own(h: Harness, caplog) -> None:
    pid = booted(h)
    h.arbiter.events = events = Recorder()
    caplog.set_level(logging.INFO)
    h.send(pid, leased(7))
    h.send(pid, done(7, channel.EXPANDED))
    assert [c[0] for c in events.calls] == ["leased"]  # not `finished`: no step counted
    assert "made its items" in caplog.text and "completed" not in caplog.text
    for n in range(2):
        h.send(pid, leased(10 + n, item=n))
        h.send(pid, done(10 + n, "completed"))
    assert [c[2] for c in events.calls if c[0] == "finished"] == ["completed", "completed"]


def test_traces_hear_of_each_attempt_and_the_kill_that_ended_it(h: Harness) -> None:
    h.arbiter.traces = traces = Recorder()
    pid = booted(h)
    h.send(pid, leased(7))
    h.send(pid, done(7, "completed"))
    h.send(pid, leased(9, kill_after=1.0))
    h.clock.advance(1.5)
    h.arbiter.tick()  # past its timeout: SIGTERM
    h.clock.advance(5)
    h.arbiter.tick()  # past kill_grace: SIGKILL
    h.exit(pid, ExitStatus(signal=signal.SIGKILL))
    names = [(c[0], c[1].step_id) for c in traces.calls]
    assert names == [
        ("started", 7), ("reported", 7), ("started", 9), ("killing", 9), ("killing", 9),
        ("ended", 9),
    ]
    assert [c[4] for c in traces.calls if c[0] == "killing"] == [False, True]  # TERM, KILL
    ended = traces.calls[-1]
    assert ended[2] == "killed" and ended[4] == "timeout"


def test_step_fields_name_a_workers_step_on_every_line() -> None:
    current: list = [None]
    fields = StepFields(lambda: current[0])
    record = logging.LogRecord("handler", logging.INFO, __file__, 1, "hello", None, None)
    fields.filter(record)
    assert "run_id" not in json.loads(JsonFormatter().format(record))
    current[0] = SimpleNamespace(  # the worker's Lease, as its keeper holds it
        run_id=RUN, step_id=7, workflow="wf", node="each", attempt=1, item_index=2
    )
    fields.filter(record)
    line = json.loads(JsonFormatter().format(record))
    assert (line["run_id"], line["step_id"], line["item"]) == (RUN, 7, 2)

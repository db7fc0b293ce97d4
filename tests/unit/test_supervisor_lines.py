"""The supervisor's own lines say what happened in words (issue 27, item 13): the signal that
started a drain, and what each scanner sweep did."""

from __future__ import annotations

import logging
import signal

import pytest
from fakes import Harness

from cyclone.engine.sweeps import SWEEPS


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_drain_names_its_signal(h: Harness, caplog, signum: signal.Signals) -> None:
    h.arbiter.start()
    caplog.set_level(logging.INFO, logger="cyclone.supervisor.arbiter")
    h.arbiter.handle_signal(signum)
    assert f"{signal.Signals(signum).name}: draining" in caplog.text
    h.arbiter.handle_signal(signum)
    assert f"second stop signal ({signal.Signals(signum).name})" in caplog.text


def test_every_sweep_says_what_it_did_in_words() -> None:
    said = {s.name: s.describe(3) for s in SWEEPS}
    assert said["sleeps"] == "woke 3 sleeping step(s)"
    assert said["expired_leases"] == "reclaimed 3 expired lease(s)"
    for name, line in said.items():
        assert "3" in line and line != "3" and len(line.split()) >= 3, (name, line)

"""A signal no wait node listens for (issue 27, item 3): kept, as a signal may come before its
wait, but the client warns (UnheardSignal), `cyclone signal` says so, and `cyclone run` names
it for as long as it is kept."""

from __future__ import annotations

import asyncio
import warnings

import pytest
from cli_support import run_cli

import cyclone
from cyclone.testing import TestEnv

gate = cyclone.Workflow("unheard-gate")


@gate.task()
def prep(ctx):
    return 1


gate.wait("approval", signal="approved", after=[prep])


def test_a_mistyped_name_warns_and_is_kept(env: TestEnv) -> None:
    run_id = env.client.submit(gate)
    with pytest.warns(cyclone.UnheardSignal, match=r"listens for signal 'aproved'") as said:
        assert env.client.signal(run_id, "aproved") is True
    assert "its waits listen for 'approved'" in str(said[0].message)
    assert run_id in str(said[0].message)
    kept = env.conn.execute("SELECT name FROM cyclone_signals WHERE run_id = %s", [run_id])
    assert [r["name"] for r in kept.fetchall()] == ["aproved"]


def test_a_listened_name_before_its_wait_is_silent(env: TestEnv) -> None:
    run_id = env.client.submit(gate)  # prep has not run: the wait is not reached yet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env.client.signal(run_id, "approved") is True
    assert env.run_until_complete(run_id).state == cyclone.RunState.COMPLETED


def test_the_async_client_warns_too(env: TestEnv) -> None:
    run_id = env.client.submit(gate)

    async def send() -> bool:
        async with cyclone.AsyncClient(env.dsn) as client:
            return await client.signal(run_id, "nope")

    with pytest.warns(cyclone.UnheardSignal):
        assert asyncio.run(send()) is True


def test_the_cli_says_so_at_signal_and_at_run(env: TestEnv, capsys) -> None:
    run_id = env.client.submit(gate)
    result = run_cli(capsys, env, "signal", run_id, "aproved")
    assert result.code == 0
    assert "no wait node of workflow 'unheard-gate' listens for signal 'aproved'" in result.err
    run_cli(capsys, env, "signal", run_id, "aproved")
    shown = run_cli(capsys, env, "run", run_id)
    assert shown.code == 0
    assert "signal 'aproved' was sent (2 times) but no wait node of unheard-gate" in shown.err

    # A listened name kept for a wait not reached yet is no news.
    run_cli(capsys, env, "signal", run_id, "approved")
    assert "'approved'" not in run_cli(capsys, env, "run", run_id).err


def test_test_env_wait_with_a_timeout_raises_timeout_error(env: TestEnv) -> None:
    """Issue 27, item 18: the client's contract is a TimeoutError; under TestEnv a run that can
    only wait for a signal raises RunStuck, which is one, with the same helpful message."""
    parked = cyclone.Workflow("unheard-parked")
    parked.wait("approval", signal="approved")
    run_id = env.client.submit(parked)
    with pytest.raises(TimeoutError, match=r"can only wait: for a signal or child run"):
        env.client.wait(run_id, timeout=0.5)
    with pytest.raises(cyclone.RunStuck):
        env.client.wait(run_id, timeout=0.5)

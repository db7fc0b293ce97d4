"""Waiting at scale and through trouble, and `cyclone run ID --wait`."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest
from cli_support import run_cli
from client_faces import KINDS, make

import cyclone
from cyclone.clients import waiting
from cyclone.db import connect
from cyclone.states import RunState
from cyclone.testing import TestEnv

held = cyclone.Workflow("waiting-held")
held.wait("go", signal="go")


@held.task(after=["go"])
def finish(ctx):
    return "done"


def _sessions(env: TestEnv, name: str) -> int:
    return env.conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = %s", (name,)
    ).fetchone()["n"]


def test_hundreds_of_async_waiters_share_one_listening_connection(env: TestEnv):
    # Every session of this client carries one name, so the server can count them.
    name = f"cyclone-waiting-{id(env)}"
    dsn = psycopg.conninfo.make_conninfo(env.dsn, application_name=name)
    count = 300

    async def main() -> list[cyclone.RunStatus]:
        async with cyclone.AsyncClient(dsn, pool_size=4) as client:
            ids = await client.submit_many(held, [{}] * count)
            waits = [asyncio.ensure_future(client.wait(r, timeout=60)) for r in ids]
            while not (w := client._watcher) or len(w.watch._waiting) < count or not w.watch.heard:
                await asyncio.sleep(0.01)
            sessions = await asyncio.to_thread(_sessions, env, name)
            assert sessions <= 4 + 1  # the pool and the one listener
            # Off the loop: the waiters' registrations lock their runs until they commit.
            end_all = "UPDATE cyclone_runs SET state = 'cancelled', finished_at = now()"
            await asyncio.to_thread(env.conn.execute, end_all)
            return await asyncio.gather(*waits)

    statuses = asyncio.run(main())
    assert [s.state for s in statuses] == [RunState.CANCELLED] * count


def test_threads_waiting_on_one_client_share_its_listener(env: TestEnv):
    name = f"cyclone-waiting-{id(env)}"
    dsn = psycopg.conninfo.make_conninfo(env.dsn, application_name=name)
    env.register(held)
    with cyclone.Client(dsn, pool_size=2) as client:
        ids = client.submit_many(held, [{}] * 20)
        results: list[cyclone.RunStatus] = []
        threads = [
            threading.Thread(target=lambda r=r: results.append(client.wait(r, timeout=20)))
            for r in ids
        ]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 10
            while (
                client._watcher is None
                or len(client._watcher.watch._waiting) < len(ids)
                or not client._watcher.watch.heard
            ) and time.monotonic() < deadline:
                time.sleep(0.01)
            # The pool and the one listener. The watcher's probe opened one more session and
            # closed it: its backend may still be on its way out, so the count settles first.
            while _sessions(env, name) > 2 + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _sessions(env, name) <= 2 + 1
        finally:
            # Whatever happened, no waiter is left to outlive the test.
            for r in ids:
                env.client.signal(r, "go")
            env.run_until_idle()
            for t in threads:
                t.join()
    assert sorted(s.state for s in results) == [RunState.COMPLETED] * 20


@pytest.mark.parametrize("kind", KINDS)
def test_a_lost_listening_connection_falls_back_to_polling_and_comes_back(
    env: TestEnv, monkeypatch, kind
):
    monkeypatch.setattr(waiting, "POLL_UNHEARD", 0.05)
    monkeypatch.setattr(waiting, "POLL_HEARD", 60.0)
    monkeypatch.setattr(waiting, "LISTEN_RETRY", 0.2)
    plain = make(kind, lambda cls: cls(env.dsn))
    try:
        first, second = plain.submit_many(held, [{}, {}])
        thread = threading.Thread(target=lambda: plain.wait(first, timeout=30))
        thread.start()
        deadline = time.monotonic() + 10
        while not (plain.watch and plain.watch.heard) and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = plain.client._watcher._conn.info.backend_pid
        env.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        env.client.cancel(first)
        thread.join(timeout=10)
        assert not thread.is_alive()
        # Listening again, with a new session: the next run end wakes its waiter at once.
        while not (plain.watch.listening and plain.client._watcher._conn.info.backend_pid != pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monkeypatch.setattr(waiting, "POLL_UNHEARD", 60.0)
        threading.Timer(0.3, lambda: env.client.cancel(second)).start()
        started = time.monotonic()
        assert plain.wait(second, timeout=30).state == RunState.CANCELLED
        assert time.monotonic() - started < 10
    finally:
        plain.close()


# -- the CLI ---


def test_run_wait_exits_0_once_the_run_completed(capsys, env: TestEnv, monkeypatch):
    env.register(held)
    run_id = env.client.submit(held, {})
    registered = threading.Event()
    original = waiting.ThreadWatcher.add

    def add(self, run_id):
        future = original(self, run_id)
        registered.set()
        return future

    monkeypatch.setattr(waiting.ThreadWatcher, "add", add)

    def finish_it() -> None:
        registered.wait(10)
        env.client.signal(run_id, "go")
        env.run_until_idle()

    thread = threading.Thread(target=finish_it)
    thread.start()
    r = run_cli(capsys, env, "run", run_id, "--wait", "--timeout", "30s")
    thread.join()
    assert r.code == 0 and "completed" in r.out and "done" in r.out


def test_run_wait_exits_1_for_a_failed_or_cancelled_run_and_after_the_timeout(capsys, env: TestEnv):
    cancelled = env.client.submit(held, {})
    env.client.cancel(cancelled)
    r = run_cli(capsys, env, "run", cancelled, "--wait", "--json")
    assert r.code == 1 and r.json()["state"] == "cancelled"
    failed = env.client.submit(held, {}, run_deadline=60)
    with pytest.raises(cyclone.RunFailed):
        env.client.result(failed)
    r = run_cli(capsys, env, "run", failed, "--wait")
    assert r.code == 1 and "run deadline exceeded" in r.out
    running = env.client.submit(held, {})
    started = time.monotonic()
    r = run_cli(capsys, env, "run", running, "--wait", "--timeout", "0.3s")
    # Issue 27, item 16: "still running" has a status of its own, not failure's 1.
    assert r.code == 124 and f"run {running} is still running after 0.3s" in r.err
    assert time.monotonic() - started < 10
    r = run_cli(capsys, env, "run", running, "--timeout", "3s")
    assert r.code == 2 and "--timeout needs --wait" in r.err
    r = run_cli(capsys, env, "run", running)
    assert r.code == 0  # without --wait, the state of a run does not change the exit status


def test_only_runs_that_are_waited_for_notify_their_end(env: TestEnv):
    alone, waited = env.client.submit_many(held, [{}, {}])
    with connect(env.dsn) as listener, cyclone.Client(env.dsn) as client:
        listener.execute("LISTEN cyclone_run_ended")
        with pytest.raises(TimeoutError):
            client.wait(waited, timeout=0)  # marks the run, then gives up
        rows = env.conn.execute("SELECT id::text FROM cyclone_runs WHERE waited").fetchall()
        assert [r["id"] for r in rows] == [waited]
        env.client.cancel(alone)
        env.client.cancel(waited)
        # Delivered in commit order: had `alone` notified, it would have come before `waited`.
        seen = []
        for n in listener.notifies(timeout=10):
            seen.append(n.payload)
            if n.payload == waited:
                break
        assert waited in seen and alone not in seen

"""A forked worker on its own: what it tells the supervisor, what it records, how it leaves."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import sys
import time
from datetime import timedelta

import psycopg
import pytest

import cyclone
from cyclone.child import channel
from cyclone.child.channel import ExitCode
from cyclone.states import RunState, StepState
from cyclone.supervisor.children import ExitStatus
from cyclone.supervisor.processes import OsProcessOps
from cyclone.worker import Worker, WorkerOptions
from cyclone.workflow import Registry

pytestmark = pytest.mark.process

pair = cyclone.Workflow("worker-pair")


@pair.task()
def first(ctx):
    return 1


@pair.task(after=[first])
def second(ctx):
    return ctx.results["first"] + 1


patient = cyclone.Workflow("worker-patient")


@patient.task(timeout=timedelta(minutes=1), max_attempts=1)
def wait_for_done(ctx):
    ctx.done.wait(30)
    return "stopped" if ctx.done.is_set() else "timed out"


slow = cyclone.Workflow("worker-slow")


@slow.task(timeout=timedelta(minutes=1))
def nap(ctx):
    time.sleep(0.5)
    return "rested"


sleepy = cyclone.Workflow("worker-async")


@sleepy.task(timeout=timedelta(minutes=1), max_attempts=1)
async def doze(ctx):
    loop = asyncio.get_running_loop()
    # A handler that takes a signal for its own loop takes the wakeup fd and the signal's
    # handler too, and closing the loop resets both: the worker must still hear SIGTERM (and
    # leave as STOPPED, not die of it) in the steps that follow.
    if ctx.input.get("take"):
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
    if ctx.input.get("stay"):
        await asyncio.sleep(30)
    return "awake"


leaving = cyclone.Workflow("worker-leaving")


@leaving.task(timeout=timedelta(minutes=1), max_attempts=2)
def leave_how(ctx):
    if ctx.attempt == 1 and ctx.input["how"] == "os._exit":
        os._exit(3)  # the worker's own BOOT_ERROR code, from the handler
    if ctx.attempt == 1 and ctx.input["how"] == "sys.exit":
        sys.exit(2)
    return ctx.attempt


class Forked:
    def __init__(self, env, max_steps: int = 0, heartbeat: float = 0.2) -> None:
        options = WorkerOptions(
            number=1, dsn=env.dsn, lease_ttl=max(3.0, heartbeat * 3),
            heartbeat_interval=heartbeat, poll_interval=0.05, max_steps=max_steps,
        )  # fmt: skip
        registry = Registry([pair, patient, slow, sleepy, leaving])
        self.pid, self.fd = OsProcessOps().spawn(
            Worker(options, registry, parent=os.getpid()).run, close_fds=[]
        )
        self.buffer = channel.LineBuffer()
        self.messages: list[channel.Message] = []

    def read_until(self, verb: str, timeout: float = 10) -> channel.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, message in enumerate(self.messages):
                if message.verb == verb:
                    del self.messages[: i + 1]
                    return message
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if ready:
                data = os.read(self.fd, 65536)
                self.messages += [channel.decode(x) for x in self.buffer.feed(data)]
        pytest.fail(f"no {verb} from the worker within {timeout}s")

    def rest(self) -> list[channel.Message]:
        """Every message still unread, up to the end of the pipe (after the worker exited)."""
        while data := os.read(self.fd, 65536):
            self.messages += [channel.decode(x) for x in self.buffer.feed(data)]
        return self.messages

    def wait_exit(self, timeout: float = 10) -> ExitStatus:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return ExitStatus.decode(status)
            time.sleep(0.02)
        pytest.fail("the worker did not exit")

    def close(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError, PermissionError):
            pass
        os.close(self.fd)


@pytest.fixture
def forked(env):
    env.register(pair, patient, slow, sleepy, leaving)
    started: list[Forked] = []

    def start(max_steps: int = 0, heartbeat: float = 0.2) -> Forked:
        started.append(Forked(env, max_steps, heartbeat))
        return started[-1]

    yield start
    for worker in started:
        worker.close()


def test_a_worker_reports_each_step_and_recycles_after_max_steps(env, forked) -> None:
    run_id = env.client.submit(pair, {})
    worker = forked(max_steps=2)
    worker.read_until("ready")
    leased = worker.read_until("leased")
    assert (leased.workflow, leased.node, leased.attempt) == ("worker-pair", "first", 1)
    assert leased.kill_after > 0 and leased.deadline_left is None
    done = worker.read_until("done")
    assert (done.step_id, done.outcome) == (leased.step_id, "completed")
    assert worker.read_until("leased").node == "second"
    worker.read_until("done")
    assert worker.wait_exit() == ExitStatus(code=ExitCode.RECYCLE)
    assert env.client.get_run(run_id).output == {"second": 2}
    # Its own exit, announced (channel.leave), as every exit of its own is.
    assert worker.rest()[-1] == channel.Exit(code=ExitCode.RECYCLE)


def test_an_idle_worker_says_so_once_and_leaves_on_sigusr1(forked) -> None:
    worker = forked()
    worker.read_until("ready")
    worker.read_until("idle")
    time.sleep(0.2)
    os.kill(worker.pid, signal.SIGUSR1)
    assert worker.wait_exit() == ExitStatus(code=ExitCode.OK)
    assert not any(m.verb == "idle" for m in worker.rest())


def test_sigterm_sets_ctx_done_and_the_worker_leaves_without_recording(env, forked) -> None:
    run_id = env.client.submit(patient, {})
    worker = forked(heartbeat=30)  # the signal itself wakes the keeper, not a heartbeat
    worker.read_until("leased")
    os.kill(worker.pid, signal.SIGTERM)
    assert worker.wait_exit(5) == ExitStatus(code=ExitCode.STOPPED)
    (step,) = env.client.steps(run_id)
    assert step.state == StepState.RUNNING  # the supervisor writes the outcome, not the worker
    assert worker.rest()[-1] == channel.Exit(code=ExitCode.STOPPED)


def test_sigterm_cancels_an_async_handler_even_after_one_took_the_wakeup_fd(env, forked):
    first = env.client.submit(sleepy, {"take": True})
    worker = forked(heartbeat=30)  # no heartbeat wakes the keeper by chance
    assert worker.read_until("done").outcome == "completed"
    assert env.client.get_run(first).state == RunState.COMPLETED
    second = env.client.submit(sleepy, {"stay": True})
    assert worker.read_until("leased").run_id == second
    os.kill(worker.pid, signal.SIGTERM)
    # Well inside the handler's 30 s sleep: its task was cancelled through ctx.done.
    assert worker.wait_exit(5) == ExitStatus(code=ExitCode.STOPPED)


def test_sigusr1_lets_the_running_step_finish_and_be_recorded(env, forked) -> None:
    run_id = env.client.submit(slow, {})
    worker = forked()
    worker.read_until("leased")
    os.kill(worker.pid, signal.SIGUSR1)
    assert worker.read_until("done").outcome == "completed"
    assert worker.wait_exit() == ExitStatus(code=ExitCode.OK)
    assert env.client.get_run(run_id).state == RunState.COMPLETED


def test_a_handlers_os_exit_is_not_announced_as_the_workers_own(env, forked) -> None:
    env.client.submit(leaving, {"how": "os._exit"})
    worker = forked()
    worker.read_until("leased")
    assert worker.wait_exit() == ExitStatus(code=ExitCode.BOOT_ERROR)
    assert not any(m.verb == "exit" for m in worker.rest())


def test_sys_exit_in_a_handler_fails_its_attempt_and_the_worker_goes_on(env, forked) -> None:
    run_id = env.client.submit(leaving, {"how": "sys.exit"})
    worker = forked()
    worker.read_until("leased")
    done = worker.read_until("done")
    assert (done.outcome, done.retry) == ("failed", True)
    assert done.error == "handler raised SystemExit(2)"
    assert os.waitpid(worker.pid, os.WNOHANG) == (0, 0)  # still there
    (first,) = env.client.attempts(env.client.steps(run_id)[0].id)
    assert first.error_kind == "crashed"


def test_a_worker_whose_lease_nobody_renews_stops_before_it_could_lapse(env, forked) -> None:
    # Forked alone, with no supervisor to renew its lease (as under a frozen one): its keeper
    # ends it once the lease's trust (lease_ttl - heartbeat_interval, here 2.8 s) runs out.
    env.client.submit(patient, {})
    worker = forked()
    worker.read_until("leased")
    started = time.monotonic()
    assert worker.wait_exit(10) == ExitStatus(code=ExitCode.LEASE_LOST)
    assert 2.5 < time.monotonic() - started < 6.0
    assert not any(m.verb == "beat" for m in worker.rest())  # it never renews on its own


def test_a_worker_whose_supervisor_is_gone_leaves(env, forked) -> None:
    worker = forked()
    worker.read_until("ready")
    os.close(worker.fd)
    worker.fd = os.open(os.devnull, os.O_RDONLY)  # so close() has something to close
    env.client.submit(pair, {})
    assert worker.wait_exit() == ExitStatus(code=ExitCode.ORPHANED)


def test_worker_sessions_end_a_transaction_left_idle_for_a_lease(env) -> None:
    # A transaction left open (by a worker frozen mid-step, say) holds its locks for a lease
    # at most: PostgreSQL ends the session and rolls it back.
    options = WorkerOptions(
        number=1, dsn=env.dsn, lease_ttl=1.0, heartbeat_interval=0.25, poll_interval=0.05,
        max_steps=0,
    )  # fmt: skip
    worker = Worker(options, Registry([pair]), parent=os.getpid())
    for conn in (worker.db(), worker.effects_db()):
        try:
            row = conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
            assert row["idle_in_transaction_session_timeout"] == "1s"
            pid = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]
            conn.rollback()
            conn.execute("BEGIN" if conn.autocommit else "SELECT 1")  # then left idle in it
            started = time.monotonic()
            wait_for_session_end(env, pid, timeout=10)
            assert time.monotonic() - started >= 0.5  # ended by the timeout, not at once
            with pytest.raises(psycopg.Error):
                conn.execute("SELECT 1")
        finally:
            conn.close()
    assert worker.effects_conn is not None and not worker.effects_conn.autocommit


def wait_for_session_end(env, pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = env.conn.execute(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = %s", [pid]
        ).fetchone()
        if row["n"] == 0:
            return
        time.sleep(0.05)
    pytest.fail(f"session {pid} still there after {timeout}s idle in its transaction")

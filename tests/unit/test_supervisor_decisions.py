"""The supervisor's decisions, driven by a fake process layer, a fake store and a fake clock."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest
from fakes import CONFIG, FakeFactory, Harness, tok

from cyclone.child import channel
from cyclone.engine import FINISHED
from cyclone.states import ErrorKind
from cyclone.supervisor.arbiter import (
    BOOT_BACKOFF,
    EXIT_HALTED,
    FAST_EXIT,
    MAX_BOOT_FAILURES,
    REPORT_WAIT,
    ArbiterConfig,
)
from cyclone.supervisor.children import (
    DEADLINE_MARGIN,
    ExitStatus,
    KillReason,
    Role,
)

KILLED = ExitStatus(signal=signal.SIGKILL)
CLEAN = ExitStatus(code=0)


def test_start_spawns_the_configured_workers_and_one_scanner(h: Harness) -> None:
    h.arbiter.start()
    roles = sorted(handle.role for handle in h.arbiter.children.values())
    assert roles == [Role.SCANNER, Role.WORKER, Role.WORKER]
    assert sorted(handle.number for handle in h.arbiter.workers()) == [1, 2]


def test_a_step_past_its_timeout_gets_sigterm_then_its_group_sigkill_after_kill_grace(
    h: Harness,
) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=2.0)
    h.clock.advance(1.9)
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == []
    h.clock.advance(0.2)
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == [("pid", signal.SIGTERM)]
    h.clock.advance(0.4)
    h.arbiter.tick()
    assert ("group", signal.SIGKILL) not in h.ops.signals_to(pid)
    h.clock.advance(0.2)
    h.arbiter.tick()
    assert ("group", signal.SIGKILL) in h.ops.signals_to(pid)
    assert h.store.failed == []  # recorded only once the process is dead
    h.exit(pid, KILLED)
    assert h.store.failed == [(7, tok(7), ErrorKind.TIMEOUT, "attempt 1 ran past its timeout")]
    assert h.arbiter.kills == {KillReason.TIMEOUT: 1}


def test_a_killed_worker_is_replaced_under_the_same_number(h: Harness) -> None:
    pid = h.started()[0]
    number = h.arbiter.children[pid].number
    h.lease(pid, kill_after=0.1)
    h.clock.advance(0.2)
    h.arbiter.tick()
    h.exit(pid, ExitStatus(code=channel.ExitCode.STOPPED))
    assert pid not in h.arbiter.children
    new = [x for x in h.workers() if x not in h.ops.spawned[:3]]
    assert len(new) == 1 and h.arbiter.children[new[0]].number == number


def test_a_worker_that_stops_cooperatively_still_loses_its_whole_group(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=1.0)
    h.clock.advance(1.0)
    h.arbiter.tick()
    h.exit(pid, ExitStatus(code=channel.ExitCode.STOPPED))
    assert ("group", signal.SIGKILL) in h.ops.signals_to(pid)
    assert [f[2] for f in h.store.failed] == [ErrorKind.TIMEOUT]


def test_kill_grace_zero_kills_at_once(h: Harness) -> None:
    h = Harness(replace(CONFIG, kill_grace=0.0))
    pid = h.started()[0]
    h.lease(pid, kill_after=1.0)
    h.clock.advance(1.0)
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == [("group", signal.SIGKILL), ("pid", signal.SIGKILL)]


def test_a_worker_dying_on_its_own_mid_step_fails_the_attempt_as_crashed_at_once(
    h: Harness,
) -> None:
    pid = h.started()[0]
    h.clock.advance(FAST_EXIT)
    h.lease(pid, kill_after=None)
    h.exit(pid, ExitStatus(signal=signal.SIGSEGV))
    assert h.store.failed == [(7, tok(7), ErrorKind.CRASHED, "worker process killed by SIGSEGV")]
    assert len(h.workers()) == 2


def test_a_worker_crashing_right_after_boot_is_respawned_with_backoff(h: Harness) -> None:
    pid = h.started()[0]
    h.exit(pid, ExitStatus(code=channel.ExitCode.CRASHED))
    assert len(h.workers()) == 1
    h.clock.advance(BOOT_BACKOFF)
    h.arbiter.tick()
    assert len(h.workers()) == 2


def test_an_idle_worker_exiting_records_nothing(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid)
    h.send(pid, channel.Done(step_id=7, outcome="completed", duration=0.1, token=tok(7)))
    h.exit(pid, ExitStatus(code=channel.ExitCode.RECYCLE))
    assert h.store.failed == []
    assert len(h.workers()) == 2


def test_a_done_message_still_in_the_pipe_at_exit_is_read_first(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid)
    fd = h.arbiter.children[pid].fd
    done = channel.Done(step_id=7, outcome="completed", duration=1, token=tok(7))
    h.ops.pipes[fd].append(channel.encode(done))
    h.exit(pid, ExitStatus(code=channel.ExitCode.RECYCLE))
    assert h.store.failed == []


def test_a_cancelled_run_kills_its_worker_without_writing(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.store.revocations = {7: "cancelled"}
    h.arbiter.on_notify()
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == [("pid", signal.SIGTERM)]
    h.clock.advance(0.5)
    h.arbiter.tick()
    assert ("group", signal.SIGKILL) in h.ops.signals_to(pid)
    h.exit(pid, KILLED)
    assert h.store.failed == []
    assert h.arbiter.kills == {KillReason.CANCEL: 1}


def test_revocations_are_polled_every_poll_interval_without_notifications(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.arbiter.tick()
    assert h.store.revoked_calls == 1
    h.clock.advance(0.5)
    h.arbiter.tick()
    assert h.store.revoked_calls == 1
    h.clock.advance(0.6)
    h.arbiter.tick()
    assert h.store.revoked_calls == 2


def test_with_notifications_polling_is_only_a_safety_net(h: Harness) -> None:
    h.arbiter.set_notifications(True)
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.arbiter.tick()
    h.clock.advance(2.0)
    h.arbiter.tick()
    assert h.store.revoked_calls == 1
    h.arbiter.on_notify()
    h.arbiter.tick()
    assert h.store.revoked_calls == 2


def test_idle_supervisors_do_not_query_for_revocations(h: Harness) -> None:
    h.started()
    h.arbiter.on_notify()
    h.arbiter.tick()
    assert h.store.revoked_calls == 0


def test_a_revocation_of_a_step_the_worker_already_finished_kills_nobody(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.store.revocations = {7: None}
    fd = h.arbiter.children[pid].fd
    done = channel.Done(step_id=7, outcome="completed", duration=1, token=tok(7))
    h.ops.pipes[fd].append(channel.encode(done))
    h.arbiter.on_notify()
    # The done line arrives between the query and the decision.
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == []


def test_a_step_its_worker_recorded_but_has_not_reported_yet_kills_nobody(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.store.revocations = {7: FINISHED}  # recorded; the done line is still on its way
    h.arbiter.on_notify()
    h.arbiter.tick()
    h.clock.advance(REPORT_WAIT / 2)
    h.arbiter.on_notify()
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == [] and h.arbiter.kills == {}
    h.send(pid, channel.Done(step_id=7, outcome="completed", duration=1, token=tok(7)))
    h.clock.advance(REPORT_WAIT)
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == [] and h.arbiter.kills == {}


def test_a_worker_that_never_reports_a_step_it_recorded_is_killed_after_report_wait(
    h: Harness,
) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.store.revocations = {7: FINISHED}
    h.arbiter.on_notify()
    h.arbiter.tick()
    h.clock.advance(REPORT_WAIT - 0.01)
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == []
    assert h.arbiter.next_wakeup() <= h.clock() + 0.01  # the re-check is scheduled
    h.clock.advance(0.01)
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == [("pid", signal.SIGTERM)]
    assert h.arbiter.kills == {KillReason.CANCEL: 1}


def test_a_worker_killed_for_one_step_while_holding_the_next_fails_the_next_as_crashed(
    h: Harness,
) -> None:
    pid = h.started()[0]
    h.lease(pid, step_id=7, kill_after=1.0)
    h.clock.advance(1.0)
    h.arbiter.tick()  # kill ordered for step 7
    h.send(pid, channel.Done(step_id=7, outcome="completed", duration=1, token=tok(7)))
    h.lease(pid, step_id=8, kill_after=None)
    h.exit(pid, KILLED)
    assert [(f[0], f[2]) for f in h.store.failed] == [(8, ErrorKind.CRASHED)]


def test_at_the_run_deadline_the_database_decides_then_the_worker_is_killed(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=3.0, deadline_left=3.0)
    h.store.sweep_revokes = {7: "deadline"}
    h.clock.advance(3.0)
    h.arbiter.tick()
    assert h.store.swept == 0  # the margin keeps us from asking a moment too early
    h.clock.advance(DEADLINE_MARGIN)
    h.arbiter.tick()
    assert h.store.swept == 1
    assert h.ops.signals_to(pid) == [("pid", signal.SIGTERM)]
    assert h.arbiter.kills == {KillReason.DEADLINE: 1}
    h.exit(pid, KILLED)
    assert h.store.failed == []  # the sweep wrote the deadline outcome


def test_a_deadline_the_database_moved_does_not_kill(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=3.0, deadline_left=3.0)
    h.clock.advance(3.0 + DEADLINE_MARGIN)
    h.arbiter.tick()  # the run was paused and resumed: nothing revoked
    h.clock.advance(1.0)
    h.arbiter.tick()
    assert h.store.swept == 1
    assert h.ops.signals_to(pid) == []


def test_a_timeout_shorter_than_the_deadline_is_a_timeout(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=1.0, deadline_left=60.0)
    h.clock.advance(1.0)
    h.arbiter.tick()
    assert h.arbiter.children[pid].kill.reason is KillReason.TIMEOUT


def test_the_supervisor_renews_a_busy_workers_lease_every_heartbeat_whatever_it_does(
    h: Harness,
) -> None:
    # Nothing comes from the worker (its handler holds the GIL, say): the OS vouches for it.
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    for _ in range(20):  # 40 s: five leases' worth
        assert h.arbiter.next_wakeup() <= h.clock() + 2.0
        h.clock.advance(2.0)
        h.arbiter.tick()
        assert h.renewer.sent[-1] == [(7, tok(7))]
        h.renewed(7)
    assert len(h.renewer.sent) == 20 and h.arbiter.children[pid].kill is None


def test_one_statement_renews_every_lease_that_is_due_or_half_due(h: Harness) -> None:
    first, second = h.started()
    h.lease(first, step_id=7, kill_after=None)
    h.clock.advance(0.9)
    h.lease(second, step_id=8, kill_after=None)
    h.clock.advance(1.1)
    h.arbiter.tick()  # 7 is due; 8, over half a heartbeat old, goes along
    assert h.renewer.sent == [[(7, tok(7)), (8, tok(8))]]
    h.renewed(7, 8)
    h.clock.advance(1.9)
    h.arbiter.tick()
    assert len(h.renewer.sent) == 1  # both renewed together: not due yet
    h.clock.advance(0.1)
    h.arbiter.tick()
    assert h.renewer.sent[-1] == [(7, tok(7)), (8, tok(8))]


def test_a_stopped_worker_is_not_renewed_and_is_sigkilled_a_heartbeat_before_its_lease_lapses(
    h: Harness,
) -> None:
    # lease_ttl 10 s, heartbeat 2 s: the lease is acted on for 8 s after its last renewal.
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.clock.advance(2.0)
    h.arbiter.tick()
    h.renewed(7)  # renewed by the statement sent at +2 s: acted on until +10 s
    h.ops.states[pid] = ("T", 31)  # SIGSTOP
    for _ in range(15):
        h.clock.advance(0.5)
        h.arbiter.tick()
    assert len(h.renewer.sent) == 1  # nothing vouched for it since
    h.clock.advance(0.4)
    h.arbiter.tick()
    assert h.ops.signals_to(pid) == []
    assert h.arbiter.next_wakeup() == pytest.approx(h.clock() + 0.1)
    h.clock.advance(0.1)
    h.arbiter.tick()
    kill = h.arbiter.children[pid].kill
    assert kill is not None and kill.reason is KillReason.FROZEN
    assert kill.record is ErrorKind.CRASHED and "frozen (stopped, no CPU" in kill.error
    # No SIGTERM first: the step may go to another worker, so the kill is at once.
    assert h.ops.signals_to(pid) == [("group", signal.SIGKILL), ("pid", signal.SIGKILL)]


def test_a_worker_resumed_before_its_trust_ran_out_is_renewed_again(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.ops.states[pid] = ("T", 0)
    h.clock.advance(2.0)
    h.arbiter.tick()
    assert h.renewer.sent == []
    h.clock.advance(3.0)
    h.ops.states[pid] = ("S", 0)  # SIGCONT
    h.arbiter.tick()
    assert h.renewer.sent == [[(7, tok(7))]]


def test_a_failed_renewal_kills_for_the_lost_session_and_gives_the_step_back(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.renewer.fail = ConnectionError("the database is gone")
    for _ in range(16):
        h.clock.advance(0.5)
        h.arbiter.tick()
        if h.arbiter.children[pid].kill is not None:
            break
    kill = h.arbiter.children[pid].kill
    assert kill is not None and kill.reason is KillReason.LOST_SESSION
    assert h.clock() == pytest.approx(1008.0)  # at the end of the lease's trust, not before
    assert h.ops.signals_to(pid) == [("group", signal.SIGKILL), ("pid", signal.SIGKILL)]
    h.exit(pid, ExitStatus(signal=signal.SIGKILL))
    assert h.store.released == [(7, tok(7))] and h.store.failed == []


def test_a_renewal_left_unanswered_kills_for_the_lost_session(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    for _ in range(16):
        h.clock.advance(0.5)
        h.arbiter.tick()  # the statement sent at +2 s never answers
    assert h.arbiter.children[pid].kill.reason is KillReason.LOST_SESSION


def test_a_lease_the_renewal_did_not_find_is_asked_about_and_its_worker_killed(
    h: Harness,
) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.arbiter.set_notifications(True)
    h.arbiter.tick()
    calls = h.store.revoked_calls
    h.clock.advance(2.0)
    h.arbiter.tick()
    h.store.revocations[7] = "cancelled"
    h.renewed()  # the token no longer matched
    h.arbiter.tick()
    assert h.store.revoked_calls == calls + 1
    assert h.arbiter.children[pid].kill.reason is KillReason.CANCEL


def test_a_renewal_answered_after_its_worker_moved_on_renews_nothing(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, step_id=7, kill_after=None)
    h.clock.advance(2.0)
    h.arbiter.tick()
    h.send(pid, channel.Done(step_id=7, outcome="completed", duration=2.0, token=tok(7)))
    h.lease(pid, step_id=8, kill_after=None, since=h.clock() - 1.0)
    h.renewed(7)
    assert h.arbiter.children[pid].lease.renewed_at == pytest.approx(h.clock() - 1.0)


def test_a_worker_whose_channel_closed_is_not_vouched_for(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.ops.pipes[h.arbiter.children[pid].fd].append(b"")  # end of file
    h.arbiter.on_readable(h.arbiter.children[pid].fd)
    for _ in range(16):
        h.clock.advance(0.5)
        h.arbiter.tick()
    assert h.renewer.sent == []
    kill = h.arbiter.children[pid].kill
    assert kill.reason is KillReason.SILENT and "channel closed" in kill.error


def test_a_lease_runs_from_when_its_statement_was_sent_not_from_when_its_line_arrived(
    h: Harness,
) -> None:
    pid = h.started()[0]
    h.clock.advance(3.0)
    h.lease(pid, kill_after=None, since=h.clock() - 3.0)  # the loop was busy for 3 s
    h.clock.advance(5.0)
    h.arbiter.tick()
    assert h.arbiter.children[pid].kill.reason is KillReason.SILENT


def test_a_late_worker_holds_the_loops_own_database_calls_off(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.clock.advance(2.9)
    assert h.arbiter.next_kill_at() is None  # renewed within 1.5 heartbeats: on time
    h.clock.advance(0.2)
    assert h.arbiter.next_kill_at() == pytest.approx(8.0 + h.clock() - 3.1)


def test_a_reclaimed_lease_is_killed_without_grace(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.store.revocations[7] = "lease_expired"
    h.arbiter.notified = True
    h.arbiter.tick()
    assert h.arbiter.children[pid].kill.reason is KillReason.LEASE_EXPIRED
    assert h.ops.signals_to(pid) == [("group", signal.SIGKILL), ("pid", signal.SIGKILL)]


def test_boot_failures_back_off_exponentially_then_halt(h: Harness) -> None:
    h.arbiter.start()
    for pid in list(h.arbiter.children):
        h.ops.exits.append((pid, ExitStatus(code=channel.ExitCode.BOOT_ERROR)))
    h.arbiter.tick()
    assert h.arbiter.boot_failures == 3
    assert h.arbiter.children == {}
    delay = BOOT_BACKOFF * 4
    h.clock.advance(delay - 0.01)
    h.arbiter.tick()
    assert h.arbiter.children == {}
    h.clock.advance(0.02)
    h.arbiter.tick()
    assert len(h.arbiter.children) == 1  # one probe at a time
    while not h.arbiter.halted:
        (pid,) = h.arbiter.children
        h.clock.advance(60)
        h.exit(pid, ExitStatus(code=channel.ExitCode.BOOT_ERROR))
        h.clock.advance(60)
        h.arbiter.tick()
    assert h.arbiter.boot_failures == MAX_BOOT_FAILURES
    assert h.arbiter.finished and h.arbiter.exit_code == EXIT_HALTED


def test_one_successful_boot_resets_the_backoff(h: Harness) -> None:
    h.arbiter.start()
    pid = h.workers()[0]
    h.exit(pid, ExitStatus(code=channel.ExitCode.BOOT_ERROR))
    assert h.arbiter.boot_failures == 1
    h.boot(h.workers()[0])
    assert h.arbiter.boot_failures == 0


def test_a_failed_fork_is_retried_later(h: Harness) -> None:
    h.ops.fail_fork = True
    h.arbiter.start()
    assert h.arbiter.children == {}
    h.ops.fail_fork = False
    h.arbiter.tick()
    assert h.arbiter.children == {}
    h.clock.advance(BOOT_BACKOFF)
    h.arbiter.tick()
    assert len(h.arbiter.children) == 3


def test_sigterm_drains_workers_and_exits_once_they_are_gone(h: Harness) -> None:
    pids = h.started()
    h.lease(pids[0], kill_after=None)
    h.arbiter.handle_signal(signal.SIGTERM)
    for pid in h.arbiter.children:
        role = h.arbiter.children[pid].role
        expected = signal.SIGUSR1 if role is Role.WORKER else signal.SIGTERM
        assert h.ops.signals_to(pid) == [("pid", expected)]
    for pid in list(h.arbiter.children):
        if pid != pids[0]:
            h.exit(pid, CLEAN)
    assert not h.arbiter.finished and len(h.ops.spawned) == 3  # no respawn while draining
    h.send(pids[0], channel.Done(step_id=7, outcome="completed", duration=1, token=tok(7)))
    h.exit(pids[0], CLEAN)
    assert h.arbiter.finished and h.arbiter.exit_code == 0
    assert h.store.failed == []


def test_a_drain_past_shutdown_timeout_kills_and_releases(h: Harness) -> None:
    pids = h.started()
    h.lease(pids[0], kill_after=None)
    h.arbiter.handle_signal(signal.SIGTERM)
    h.clock.advance(5.0)
    h.arbiter.tick()
    assert ("group", signal.SIGKILL) in h.ops.signals_to(pids[0])
    for pid in list(h.arbiter.children):
        h.ops.exits.append((pid, KILLED))
    h.arbiter.tick()
    # A planned stop is not the step's doing: released, its attempt not spent.
    assert h.store.failed == []
    assert h.store.released == [(7, tok(7))]
    assert h.arbiter.finished and h.arbiter.exit_code == 0
    assert h.arbiter.kills[KillReason.SHUTDOWN] == 3


def test_a_second_stop_signal_releases_the_steps_it_kills(h: Harness) -> None:
    pids = h.started()
    h.lease(pids[0], kill_after=None)
    h.arbiter.handle_signal(signal.SIGTERM)
    h.arbiter.handle_signal(signal.SIGTERM)
    for pid in list(h.arbiter.children):
        h.ops.exits.append((pid, KILLED))
    h.arbiter.tick()
    assert (h.store.failed, h.store.released) == ([], [(7, tok(7))])


def test_a_timeout_kill_ordered_before_the_stop_still_records_its_timeout(h: Harness) -> None:
    pids = h.started()
    h.lease(pids[0], kill_after=1.0)
    h.clock.advance(1.0)
    h.arbiter.tick()
    h.arbiter.handle_signal(signal.SIGTERM)
    h.arbiter.handle_signal(signal.SIGTERM)
    h.exit(pids[0], KILLED)
    assert [f[2] for f in h.store.failed] == [ErrorKind.TIMEOUT] and h.store.released == []


def test_a_second_sigint_kills_at_once(h: Harness) -> None:
    pid = h.started()[0]
    h.arbiter.handle_signal(signal.SIGINT)
    h.arbiter.handle_signal(signal.SIGINT)
    assert ("group", signal.SIGKILL) in h.ops.signals_to(pid)


def test_ttin_adds_a_worker_and_ttou_retires_an_idle_one(h: Harness) -> None:
    pids = h.started()
    h.arbiter.handle_signal(signal.SIGTTIN)
    h.arbiter.tick()
    assert len(h.workers()) == 3
    h.lease(pids[0], kill_after=None)
    h.arbiter.handle_signal(signal.SIGTTOU)
    h.arbiter.tick()
    retired = [x for x in h.workers() if h.arbiter.children[x].retiring]
    assert len(retired) == 1 and retired[0] != pids[0]
    assert h.ops.signals_to(retired[0]) == [("pid", signal.SIGUSR1)]
    h.arbiter.handle_signal(signal.SIGTTOU)
    h.arbiter.handle_signal(signal.SIGTTOU)
    assert h.arbiter.target == 1


def test_sighup_starts_new_children_and_retires_the_old_gracefully(h: Harness) -> None:
    old = set(h.arbiter.children) if h.started() else set()
    h.next_config = replace(CONFIG, workers=3)
    h.arbiter.handle_signal(signal.SIGHUP)
    h.arbiter.tick()
    assert all(h.arbiter.children[pid].retiring for pid in old)
    new = [pid for pid in h.arbiter.children if pid not in old]
    assert len(new) == 4  # three workers and a scanner
    for pid in old:
        h.exit(pid, CLEAN)
    assert len(h.arbiter.children) == 4


def test_a_bad_reload_keeps_the_running_children(h: Harness, caplog) -> None:
    h.started()

    def broken() -> tuple[ArbiterConfig, FakeFactory]:
        from cyclone.errors import ConfigError

        raise ConfigError("cyclone.toml: [supervisor] workers: expected an integer")

    h.arbiter.reload = broken
    h.arbiter.handle_signal(signal.SIGHUP)
    assert not any(handle.retiring for handle in h.arbiter.children.values())
    assert "keeping the old config" in caplog.text


def test_the_scanner_is_respawned_when_it_dies(h: Harness) -> None:
    h.started()
    (scanner,) = [p for p, x in h.arbiter.children.items() if x.role is Role.SCANNER]
    h.clock.advance(FAST_EXIT)
    h.exit(scanner, ExitStatus(code=1))
    assert sum(x.role is Role.SCANNER for x in h.arbiter.children.values()) == 1


def test_no_scanner_when_disabled() -> None:
    h = Harness(replace(CONFIG, scanner=False))
    h.arbiter.start()
    assert all(x.role is Role.WORKER for x in h.arbiter.children.values())


def test_unknown_children_are_reaped_quietly(h: Harness) -> None:
    h.started()
    h.exit(4242, CLEAN)
    assert len(h.arbiter.children) == 3


def test_the_loop_wakes_for_the_next_kill(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=0.25)
    assert h.arbiter.next_wakeup() == pytest.approx(h.clock.now + 0.0)  # poll due now
    h.arbiter.tick()
    assert h.arbiter.next_wakeup() == pytest.approx(h.clock.now + 0.25)
    h.clock.advance(0.25)
    h.arbiter.tick()
    assert h.arbiter.next_wakeup() == pytest.approx(h.clock.now + 0.5)


def test_the_loop_does_not_spin_while_a_killed_worker_awaits_its_reaping(h: Harness) -> None:
    pid = h.started()[0]
    h.lease(pid, kill_after=0.1)
    h.clock.advance(1.0)
    h.arbiter.tick()  # SIGTERM
    h.clock.advance(0.5)
    h.arbiter.tick()  # SIGKILL; the process is not reaped yet
    assert h.arbiter.next_wakeup() > h.clock.now


def test_one_failed_renewal_costs_nothing() -> None:
    # Its session was terminated (a restart, pg_terminate_backend): the next try comes soon
    # enough to land within the lease's trust, here two heartbeats (lease 3 s, heartbeat 1 s).
    h = Harness(replace(CONFIG, lease_ttl=3.0, heartbeat_interval=1.0))
    pid = h.started()[0]
    h.lease(pid, kill_after=None)
    h.clock.advance(1.0)
    h.arbiter.tick()
    h.renewer.in_flight = False
    h.arbiter.renewal_failed(ConnectionError("terminating connection"))
    for _ in range(12):
        h.clock.advance(0.25)
        h.arbiter.tick()
        if h.renewer.in_flight:
            h.renewed(7)
    assert len(h.renewer.sent) >= 3 and h.arbiter.children[pid].kill is None

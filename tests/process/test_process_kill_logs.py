"""A normal cancel or deadline kill logs its real reason only (issue 27, item 5): no line about
a lost lease or a `lease_lost` exit, which read as an outage to an operator. And a map's item
lines name their index, its evaluating row is no step of its own (item 4)."""

from __future__ import annotations

import re

from proc_helpers import terminal, wait_for

from cyclone.states import RunState

LEASE_WORDS = re.compile(r"lease lost|lease_lost|lease not renewed|lease was gone", re.I)


def test_cancel_and_deadline_kills_say_only_why(env, supervisor, tmp_path) -> None:
    sup = supervisor(workers=3)
    cancelled = env.client.submit("proc-stubborn", {"dir": str(tmp_path)})
    overdue = env.client.submit("proc-stubborn", {"dir": str(tmp_path)}, run_deadline=1.5)
    polite = env.client.submit("proc-polite", {"dir": str(tmp_path)})
    wait_for(lambda: (tmp_path / f"{cancelled}.1.pids").exists(), 15, sup.log())
    wait_for(lambda: (tmp_path / f"{polite}.started").exists(), 15, sup.log())
    env.client.cancel(cancelled)
    env.client.cancel(polite)  # its handler returns on ctx.done, within kill_grace
    for run_id in (cancelled, overdue, polite):
        wait_for(lambda rid=run_id: terminal(env, rid), 30, f"run {run_id} to end\n{sup.log()}")
    assert env.client.get_run(cancelled).state == RunState.CANCELLED
    assert env.client.get_run(overdue).state == RunState.FAILED
    wait_for(lambda: sup.log().count(" killed after ") >= 3, 10, sup.log())
    log = sup.log()
    assert re.search(rf"run={cancelled} attempt=1 killed after \S+ \(cancel\)", log), log
    assert re.search(rf"run={overdue} attempt=1 killed after \S+ \(deadline\)", log), log
    assert re.search(rf"run={polite} attempt=1 killed after \S+ \(cancel\)", log), log
    assert not LEASE_WORDS.search(log), LEASE_WORDS.search(log)

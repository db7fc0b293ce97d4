"""Flow control across real supervisors: a VM serves only its queues, and runs per key and
steps per node hold across VMs (each step's start and end in a ledger, on this host's
monotonic clock)."""

from __future__ import annotations

from pathlib import Path

from proc_flows import flow_keyed, flow_mail, flow_narrow, most_at_once, spans
from proc_helpers import completed, wait_for

from cyclone.testing import TestEnv


def test_queues_keys_and_node_limits_hold_across_two_supervisors(
    env: TestEnv, supervisor, tmp_path: Path
) -> None:
    env.register(flow_mail, flow_keyed, flow_narrow)
    spec = {"dir": str(tmp_path), "seconds": 0.3}
    mail = env.client.submit(flow_mail, spec)
    keyed = env.client.submit_many(flow_keyed, [{**spec, "k": f"k{i % 2}"} for i in range(6)])
    narrow = env.client.submit_many(flow_narrow, [{**spec, "k": str(i)} for i in range(4)])
    # Neither VM serves the emails queue: its run waits, however idle the workers are.
    supervisor(workers=3, supervisor__queues='["default"]')
    supervisor(workers=3, supervisor__queues="{ default = 2 }")
    for run_id in keyed + narrow:
        wait_for(lambda r=run_id: completed(env, r), 60, f"run {run_id} to complete")
    assert env.client.get_run(mail).state == "running"
    # Its step waits in the lease index, or parked out of it once the scanner's `unserved`
    # sweep saw no live VM serving its workflow (docs/deploys.md).
    assert env.client.steps(mail)[0].state in ("available", "waiting")
    keyed_spans = spans(tmp_path, flow_keyed.name)
    assert len(keyed_spans) == 6
    for key in ("k0", "k1"):
        assert most_at_once([s for s in keyed_spans if s[2] == key]) == 1, key
    assert most_at_once(keyed_spans) <= 2
    assert most_at_once(spans(tmp_path, flow_narrow.name)) == 1
    # A VM that serves the queue takes its run.
    supervisor(workers=1, supervisor__queues='["proc-emails"]')
    wait_for(lambda: completed(env, mail), 30, "the emails run to complete")

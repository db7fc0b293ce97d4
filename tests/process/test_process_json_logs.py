"""`[logging] format = "json"` (SPEC section 16): one object a line, from every process, and a
line about a step names it whole: run id, step id, workflow, node, attempt. A handler's own
log lines, written in its worker, carry the step they ran in."""

from __future__ import annotations

import json

from proc_helpers import completed, wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_json_lines_name_their_step(env, supervisor, monkeypatch) -> None:
    sup = supervisor(logging__format='"json"')
    # Submitted in a trace (from the environment, as the CLI takes it): a handler's lines
    # carry its id, so the trace's UI and the logs find each other.
    monkeypatch.setenv("TRACEPARENT", f"00-{TRACE_ID}-00f067aa0ba902b7-01")
    run_id = env.client.submit("proc-traced")
    wait_for(lambda: completed(env, run_id), 30, f"run {run_id} to complete\n{sup.log()}")

    def lines() -> list[dict]:
        return [json.loads(line) for line in sup.log().splitlines() if line.strip()]

    def about(node: str) -> list[dict]:
        return [r for r in lines() if r.get("node") == node and r.get("run_id") == run_id]

    # The supervisor's outcome line: in the log once the run completed (same loop iteration).
    outcome = wait_for(
        lambda: [r for r in about("first") if r.get("action") == "step"], 10, sup.log()
    )[0]
    assert outcome["workflow"] == "proc-traced"
    assert outcome["attempt"] == 1
    assert isinstance(outcome["step_id"], int)
    assert run_id in outcome["msg"]  # whole, as `cyclone run` takes it

    (said,) = [r for r in about("first") if r["msg"] == "first step says hello"]
    assert said["logger"] == "proc.traced"
    assert said["step_id"] == outcome["step_id"]
    assert said["pid"] != sup.pid  # written by the worker
    assert said["trace_id"] == TRACE_ID
    # Lines about no step carry no step fields.
    started = [r for r in lines() if r["msg"].startswith("supervisor ") and "started" in r["msg"]]
    assert started and "run_id" not in started[0]

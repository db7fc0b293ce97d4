"""A workflow that declares a schedule, for the supervisors of test_process_schedules.py (a
module of its own: a schedule declared in proc_flows would tick under every process test)."""

from __future__ import annotations

import cyclone

declared = cyclone.Workflow("proc-declared")
declared.wait("approval")
declared.schedule("declared-every-second", every=1, overlap="allow_all", input={"from": "code"})

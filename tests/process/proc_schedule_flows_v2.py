"""proc_schedule_flows with its schedule removed from the code: a supervisor that loads it
reports the schedule, and leaves it in place."""

from __future__ import annotations

import cyclone

declared = cyclone.Workflow("proc-declared")
declared.wait("approval")

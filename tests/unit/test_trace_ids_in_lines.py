"""JSON log lines carry the trace id of their step's run, where it has one (issue 27, item 2)."""

from __future__ import annotations

from cyclone.supervisor.children import HeldLease
from cyclone.supervisor.outcomes import step_extra
from cyclone.tracecontext import trace_id_of


def lease(trace_id: str | None) -> HeldLease:
    return HeldLease(
        step_id=7, token="t", run_id="r", workflow="w", node="n", attempt=1, leased_at=0.0,
        timeout_at=None, deadline_at=None, trace_id=trace_id,
    )  # fmt: skip


def test_the_supervisors_lines_carry_a_looked_up_trace_id_and_none_without() -> None:
    assert step_extra(lease("4bf92f3577b34da6a3ce929d0e0e4736"), "step")["trace_id"] == (
        "4bf92f3577b34da6a3ce929d0e0e4736"
    )
    assert "trace_id" not in step_extra(lease(None), "step")


def test_a_trace_id_is_read_from_a_well_formed_traceparent_only() -> None:
    assert trace_id_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01") == (
        "4bf92f3577b34da6a3ce929d0e0e4736"
    )
    assert trace_id_of(None) is None
    assert trace_id_of("00-nothex-00f067aa0ba902b7-01") is None

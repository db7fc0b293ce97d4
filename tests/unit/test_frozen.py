"""cyclone.frozen.quick_init: the faster __init__ of the per-step frozen dataclasses takes the
same arguments as the one dataclasses made, builds equal objects, and leaves them frozen."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from cyclone.child import channel
from cyclone.engine.dispatch import Dispatched, Finished
from cyclone.engine.steps import Lease
from cyclone.frozen import quick_init
from cyclone.runner import Outcome
from cyclone.states import NodeKind

SERVED = [
    channel.Leased, channel.Done, channel.Scanned, channel.Idle, channel.Want, channel.Given,
    channel.Exit, Lease, Outcome, Finished, Dispatched,
]  # fmt: skip


def _params(init: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(init).parameters.values()]


@pytest.mark.parametrize("cls", SERVED, ids=lambda c: c.__name__)
def test_it_takes_the_arguments_the_dataclass_init_took(cls: type) -> None:
    init = cls.__init__
    assert _params(init) == _params(init.__dataclass_init__)  # type: ignore[attr-defined]
    assert init.__qualname__ == f"{cls.__qualname__}.__init__"


def test_it_builds_equal_frozen_objects_by_position_keyword_and_default() -> None:
    lease = Lease(7, "r", "wf", "n", NodeKind.TASK, 1, 3, "t", {"a": 1}, None, None, None, "h",
                  30.0, None, 30.0)  # fmt: skip
    made = object.__new__(Lease)
    Lease.__init__.__dataclass_init__(  # type: ignore[attr-defined]
        made, 7, "r", "wf", "n", NodeKind.TASK, 1, 3, "t", {"a": 1}, None, None, None, "h", 30.0,
        None, 30.0,
    )  # fmt: skip
    assert lease == made and lease.parent_run_id is None
    assert channel.Done(step_id=1, outcome="completed", duration=0.5) == channel.Done(
        1, "completed", 0.5, None, None, None
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.attempt = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        channel.Want(lease=True, nope=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'code'"):
        channel.Exit()  # type: ignore[call-arg]
    assert hash(channel.Idle(step_id=1)) == hash(channel.Idle(step_id=1))


def test_it_refuses_a_class_it_cannot_serve() -> None:
    @dataclasses.dataclass(slots=True)
    class Mutable:
        x: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        x: list[int] = dataclasses.field(default_factory=list)

    for cls in (Mutable, Factory):
        with pytest.raises(TypeError, match="not a plain frozen slotted dataclass"):
            quick_init(cls)

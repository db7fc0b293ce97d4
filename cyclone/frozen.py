"""A faster `__init__` for the frozen dataclasses made on every step (leases, outcomes, the
channel's messages).

A frozen dataclass's generated `__init__` sets each field through `object.__setattr__`, looked
up and called anew per field: with slots, about twice what a mutable one costs (bench/README.md,
"Python CPU a step"). The `__init__` made here has the same parameters, defaults and name, and
sets each slot through its own descriptor, bound once; the class stays frozen (its
`__setattr__` still refuses), equal, hashable and printable as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def quick_init(cls: type[T]) -> type[T]:
    """Give a frozen, slotted dataclass the faster `__init__` (see the module's docstring).
    Classes it cannot serve (a default factory, a `__post_init__`, init-only or keyword-only
    fields) are refused at import, not served slowly."""
    params = dataclasses.fields(cls)  # type: ignore[arg-type]
    if not (
        dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        and "__slots__" in cls.__dict__ and not hasattr(cls, "__post_init__")
        and all(
            f.init and not f.kw_only and f.default_factory is dataclasses.MISSING
            for f in params
        )
    ):  # fmt: skip
        raise TypeError(f"quick_init: {cls.__name__} is not a plain frozen slotted dataclass")
    scope: dict[str, Any] = {}
    args, body = ["self"], []
    for f in params:
        scope[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        if f.default is dataclasses.MISSING:
            args.append(f.name)
        else:
            scope[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
        body.append(f"    _set_{f.name}(self, {f.name})")
    source = f"def __init__({', '.join(args)}):\n" + ("\n".join(body) or "    pass") + "\n"
    exec(source, scope)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__dataclass_init__ = cls.__init__  # the generated one, which tests compare it with
    cls.__init__ = init  # type: ignore[misc]
    return cls

"""How values look to an operator: tables, times and spans (the CLI and `cyclone status`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from enum import Enum
from typing import Any


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]] = (),
    *,
    wrap: Sequence[str] = ("error", "step", "run"),
) -> Any:
    """A borderless rich table. Only the `wrap` columns fold long cells: measuring wrappable
    cells is most of rich's rendering time."""
    from rich import box
    from rich.table import Table

    t = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False
    )
    for name in columns:
        t.add_column(name, overflow="fold", no_wrap=name not in wrap)
    for row in rows:
        t.add_row(*(cell(v) for v in row))
    return t


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return when(value)
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def when(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def seconds(value: float | None) -> str:
    """A span as an operator reads it: 45s, 4m05s, 2h03m, 3d04h; negative means overdue."""
    if value is None:
        return "-"
    sign, value = ("-" if value < 0 else ""), abs(value)
    whole = int(value)
    if value < 10:
        text = f"{value:.1f}s"
    elif whole < 60:
        text = f"{whole}s"
    elif whole < 3600:
        text = f"{whole // 60}m{whole % 60:02d}s"
    elif whole < 86400:
        text = f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    else:
        text = f"{whole // 86400}d{whole % 86400 // 3600:02d}h"
    return sign + text

"""How values look to an operator: tables, times and spans (the CLI and `cyclone status`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from rich.cells import cell_len

from cyclone.sanitize import plain_text, printable, printable_lines


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

    t = _plain_table()(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False
    )
    for name in columns:
        t.add_column(name, overflow="fold", no_wrap=name not in wrap)
    for row in rows:
        t.add_row(*(cell(v) for v in row))
    return t


def _plain_table() -> type:
    from rich.table import Table

    class PlainTable(Table):
        """A table whose string cells are plain text: names and errors come from users, and a
        workflow named "markup[/oops]" must show as such, not crash rich's markup parser (or
        restyle the screen), nor an escape sequence in an error reach the terminal."""

        def add_row(self, *renderables: Any, **kwargs: Any) -> None:
            # One line each: these tables hold names, ids and spans, never an error's lines.
            cells = [plain_text(r, lines=False) if isinstance(r, str) else r for r in renderables]
            super().add_row(*cells, **kwargs)

    return PlainTable


def cell(value: Any) -> str:
    """A value as shown: control characters escaped (line breaks kept: a traceback's)."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return when(value)
    if isinstance(value, Enum):
        return printable_lines(value.value)
    return printable_lines(value)


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


# --- listings: a table when it fits, one record per row when it does not ---------------------


@dataclass(frozen=True, slots=True)
class Column:
    """A listing's column. `drop` > 0 marks one an operator can spare (timestamps, spans): when
    the table is too wide those go first, highest `drop` first. `first_line` shows only the
    first line of a multi-line value in a table; a record shows the whole value.

    Only such columns (`first_line`, or `lines` where a record shows the whole value) keep a
    value's line breaks: in any other (a workflow or node name) a newline is shown as `\\n`,
    so a name cannot forge a row of its own."""

    name: str
    drop: int = 0
    first_line: bool = False
    hide_empty: bool = False  # left out when no row has a value: a column of dashes says nothing
    lines: bool = False

    def show(self, text: str) -> str:
        """`text` as this column shows it: control characters escaped, line breaks kept only
        in a column of multi-line values."""
        return printable_lines(text) if self.first_line or self.lines else printable(text)


@dataclass(frozen=True, slots=True)
class Shown:
    layout: str  # "table", or "records" (psql's \x) when even the spare-less table is too wide
    width: int
    hidden: tuple[str, ...] = ()


# Between two columns: three spaces, the look of rich's borderless tables elsewhere.
_GAP = 3


def print_listing(out: Any, columns: Sequence[Column], rows: Sequence[Sequence[Any]]) -> Shown:
    """Print rows on the console `out`, never cutting or folding a value.

    Ids and error text must reach the operator whole, so columns are never squeezed: spare
    columns are left out first, and when the rest still does not fit the console's width each
    row is printed as a record, one `name  value` line per column (like psql's `\\x`), with
    lines longer than the terminal left for it to wrap rather than cut.
    """
    if not rows:
        return Shown("empty", out.width)  # no header over nothing: the caller says "none"
    empty = {i for i, c in enumerate(columns) if c.hide_empty and all(r[i] is None for r in rows)}
    every, columns = columns, [c for i, c in enumerate(columns) if i not in empty]
    texts = [[every[i].show(cell(v)) for i, v in enumerate(row) if i not in empty] for row in rows]
    shown = list(range(len(columns)))
    widths = [_width(c.name, (r[i] for r in texts), c.first_line) for i, c in enumerate(columns)]
    spare = sorted((i for i, c in enumerate(columns) if c.drop), key=lambda i: -columns[i].drop)
    while _table_width(widths, shown) > out.width and spare:
        shown.remove(spare.pop(0))
    if _table_width(widths, shown) > out.width:
        out.print(records(columns, texts), soft_wrap=True)
        return Shown("records", out.width)
    out.print(_table(columns, texts, shown, widths))
    return Shown("table", out.width, tuple(c.name for i, c in enumerate(columns) if i not in shown))


def records(
    columns: Sequence[Column], texts: Sequence[Sequence[str]], *, numbered: bool = True
) -> Any:
    """Rows as `name  value` lines, a `-[ n ]` line before each when `numbered`; a value of
    several lines continues under its first. Print with soft_wrap so no line is cut."""
    from rich.text import Text

    pad = max((cell_len(c.name) for c in columns), default=0) + 2
    out = Text(no_wrap=True, overflow="ignore")
    for n, row in enumerate(texts, 1):
        if numbered:
            out.append(f"-[ {n} ]".ljust(pad + 20, "-") + "\n", "dim")
        for column, value in zip(columns, row, strict=True):
            # Escaped here too: not every caller's values came through cell().
            lines = column.show(value).splitlines() or [""]
            out.append(column.name.ljust(pad), "bold")
            out.append(lines[0] + "\n")
            for line in lines[1:]:
                out.append(" " * pad + line + "\n")
    out.rstrip()
    return out


def _first(value: str) -> str:
    return value.strip().splitlines()[0] if value.strip() else value


def _width(name: str, values: Iterable[str], first_line: bool) -> int:
    widest = cell_len(name)
    for value in values:
        lines = [_first(value)] if first_line else value.splitlines()
        for line in lines:
            widest = max(widest, cell_len(line))
    return widest


def _table_width(widths: Sequence[int], shown: Sequence[int]) -> int:
    return sum(widths[i] for i in shown) + _GAP * max(0, len(shown) - 1)


def _table(
    columns: Sequence[Column],
    texts: Sequence[Sequence[str]],
    shown: Sequence[int],
    widths: Sequence[int],
) -> Any:
    """The rows as a borderless table (rich's SIMPLE_HEAD look), laid out here: every width is
    known and nothing folds, and rich's Table is slow to lay out long listings (see
    bench/README.md, "Figures behind the code's comments")."""
    from rich.text import Text

    shown_widths = [widths[i] for i in shown]
    out = Text(no_wrap=True, overflow="ignore")
    out.append(_line([columns[i].name for i in shown], shown_widths), "bold")
    out.append("─" * _table_width(widths, shown) + "\n")
    for row in texts:
        cells = [
            (_first(row[i]) if columns[i].first_line else row[i]).splitlines() or [""]
            for i in shown
        ]
        for n in range(max(len(lines) for lines in cells)):
            out.append(_line([ln[n] if n < len(ln) else "" for ln in cells], shown_widths))
    out.rstrip()
    return out


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    padded = [c + " " * (w - cell_len(c)) for c, w in zip(cells, widths, strict=True)]
    return (" " * _GAP).join(padded).rstrip() + "\n"

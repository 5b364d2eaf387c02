"""Tables of ``backfill simulate`` and the benches that stay whole: :func:`print_table`.

rich fits a table to the console by shrinking its columns and cutting cells (``pol… ans… 0.…``): a
redirected run is read as 80 columns, so its figures were lost. :func:`print_table` prints rich's
table only at a terminal wide enough for all of it; otherwise (redirected, piped, captured, or a
narrow terminal) plain aligned rows (:func:`plain_table`), split into blocks of columns that fit the
terminal's width (:data:`PLAIN_WIDTH` when not a terminal), each block repeating the first column.
No cell is ever cut.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

PLAIN_WIDTH = 100
"""Width the plain text of a run that writes to no terminal keeps to (a file read later, a log)."""
GAP = "  "
"""Between two columns of the plain text."""


def _plain(cell: Any) -> str:
    """A cell's text without markup, on one line."""
    if isinstance(cell, Text):
        text = cell.plain
    elif isinstance(cell, str):
        text = Text.from_markup(cell).plain
    else:
        text = str(cell)
    return " ".join(text.split("\n"))


def plain_table(table: Table, width: int | None = None) -> str:
    """``table`` (its title, header and rows) as aligned plain text: columns ``GAP`` apart, each as wide
    as its widest cell, right-aligned where the column is. With ``width`` (characters), the columns
    after the first are split into blocks whose lines fit it (a column wider than ``width`` on its own
    gets a block of its own, never cut), each block under the title and with the first column."""
    columns = [[_plain(c.header), *(_plain(cell) for cell in c._cells)] for c in table.columns]
    if not columns:
        return _plain(table.title or "")
    widths = [max(len(cell) for cell in column) for column in columns]
    blocks: list[list[int]] = [[]]
    used = widths[0]
    for index in range(1, len(columns)):
        if width is not None and blocks[-1] and used + len(GAP) + widths[index] > width:
            blocks.append([])
            used = widths[0]
        blocks[-1].append(index)
        used += len(GAP) + widths[index]
    lines: list[str] = []
    for number, block in enumerate(blocks):
        if table.title:
            suffix = f" ({number + 1}/{len(blocks)})" if len(blocks) > 1 else ""
            lines.append(_plain(table.title) + suffix)
        shown = [0, *block]
        for row in range(len(columns[0])):
            cells = []
            for index in shown:
                cell, right = columns[index][row], table.columns[index].justify == "right"
                cells.append(cell.rjust(widths[index]) if right else cell.ljust(widths[index]))
            lines.append(GAP.join(cells).rstrip())
        if number < len(blocks) - 1:
            lines.append("")
    return "\n".join(lines)


def _terminal_width(console: Console) -> int | None:
    """The width of the terminal ``console`` writes to, or None when it writes to no terminal."""
    if not console.is_terminal:
        return None
    try:
        return os.get_terminal_size(console.file.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return console.width


def print_table(table: Table, console: Console | None = None) -> None:
    """Print ``table`` on ``console`` (default: stdout): rich's table at a terminal wide enough for its
    natural width, else :func:`plain_table` (the terminal's width, :data:`PLAIN_WIDTH` when not a
    terminal)."""
    console = console or Console()
    width = _terminal_width(console)
    if width is not None and Measurement.get(console, console.options.update(width=10_000), table).maximum <= width:
        console.print(table, width=width)
        return
    console.print(plain_table(table, width or PLAIN_WIDTH), markup=False, highlight=False, soft_wrap=True)

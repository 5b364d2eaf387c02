"""How client commands print: aligned tables with a header row, times in UTC, JSON for scripts."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import click
import orjson


def format_time(value: datetime | int | float | None) -> str:
    """``YYYY-MM-DD HH:MM:SS UTC`` of a datetime (naive ones are taken as UTC) or of Unix seconds;
    ``-`` for None."""
    if value is None:
        return "-"
    if not isinstance(value, datetime):
        value = datetime.fromtimestamp(value, UTC)
    elif value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def echo_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print ``rows`` under ``headers``, columns left-aligned and separated by two spaces."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def echo_json(value: Any) -> None:
    """Print ``value`` (an SDK model, a list of them, or plain JSON data) as indented JSON."""
    click.echo(orjson.dumps(_plain(value), option=orjson.OPT_INDENT_2).decode())


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def page_hint(shown: int, more: bool, after: str | None, total: int | None = None) -> str:
    """The line under a page of a list: ``20 of 54 shown; --after ID for more`` (``20 shown`` without
    a total; ``all 3 shown`` on the last page)."""
    if not more:
        return f"all {shown} shown" if total in (None, shown) else f"{shown} of {total} shown"
    count = f"{shown} of {total}" if total is not None else f"{shown}"
    return f"{count} shown; --after {after} for more"

"""``lab.toolkit.tables``: whole cells in plain text, split into blocks that fit, rich only at a
terminal wide enough."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from lab.toolkit.tables import PLAIN_WIDTH, plain_table, print_table


def _table(columns: int = 4) -> Table:
    table = Table(title="runs")
    table.add_column("policy")
    for index in range(1, columns):
        table.add_column(f"figure number {index}", justify="right")
    table.add_row("[bold]approximate[/]", *(f"{index * 1000.5:,.3f}" for index in range(1, columns)))
    table.add_row("round-robin", *("-" for _ in range(1, columns)))
    return table


def test_plain_rows_align_and_keep_every_cell():
    assert plain_table(_table(3)).splitlines() == [
        "runs",
        "policy       figure number 1  figure number 2",
        "approximate        1,000.500        2,001.000",
        "round-robin                -                -",
    ]


def test_a_wide_table_splits_into_blocks_that_fit_each_with_the_first_column():
    text = plain_table(_table(12), width=60)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 60 and "…" not in text
    assert all(f"figure number {index}" in text for index in range(1, 12))
    assert sum(line.startswith("round-robin") for line in lines) == text.count("runs (") > 1


def test_a_console_that_is_no_terminal_gets_plain_text_within_the_plain_width():
    out = io.StringIO()
    print_table(_table(12), Console(file=out, width=40))
    assert "…" not in out.getvalue() and "┃" not in out.getvalue()
    assert max(len(line) for line in out.getvalue().splitlines()) <= PLAIN_WIDTH
    assert "figure number 11" in out.getvalue()


def test_a_wide_enough_terminal_gets_rich_s_table():
    out = io.StringIO()
    print_table(_table(3), Console(file=out, width=120, force_terminal=True))
    assert "┃" in out.getvalue() and "approximate" in out.getvalue()

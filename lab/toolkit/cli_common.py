"""Pieces shared by more than one command's CLI (``backfill simulate``, ``backfill bench …``): click
options and the cells of their rich tables."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def mooncake_trace_options(trace_help: str) -> Callable[[F], F]:
    """The options of a Mooncake trace replay, in this order: ``--trace`` (``trace_path``: an
    existing file, help ``trace_help``), ``--trace-format`` (only ``mooncake``), ``--start-min``
    (minutes to skip, ≥ 0, default 0), ``--minutes`` (minutes to replay, > 0, default: to the end)
    and ``--speed`` (arrival speed-up, > 0, default 1); their values go to
    :func:`lab.toolkit.workloads.mooncake_trace` and
    :func:`lab.simulate.workload.mooncake_requests`. Bad values are click usage errors."""
    options = [
        click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help=trace_help),
        click.option("--trace-format", type=click.Choice(["mooncake"]), default="mooncake", show_default=True,
                     help="Format of --trace: Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)."),
        click.option("--start-min", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     help="--trace: skip the first M minutes."),
        click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="--trace: replay N minutes (default: to the end)."),
        click.option("--speed", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                     help="--trace: arrivals S times as fast as the timestamps."),
    ]

    def decorate(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def fmt_cell(value: Any, digits: int = 3) -> str:
    """A figure as a table cell: ``-`` for None, a float with ``digits`` decimals, an int with
    thousands separators, anything else as ``str``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)

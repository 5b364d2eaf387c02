"""Benchmarks: ``backfill bench NAME``. Each prints a table and writes the same figures as JSON
(``--json PATH``); docs/benchmarks.md records the latest results with the exact command."""

from __future__ import annotations

import click

from backfill.cli import LazyGroup

BENCHMARKS: dict[str, str] = {
    "ingest": "backfill.bench.ingest:ingest_command",
    "engine-sim": "router.fleet.bench:bench_engine_sim_command",
}


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench_group() -> None:
    """Run a benchmark (results are ratios measured side by side in one run)."""

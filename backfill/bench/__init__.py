"""Benchmarks: ``backfill bench NAME``. Each prints a table and writes the same figures as JSON
(``--json PATH``); docs/benchmarks.md records the latest results with the exact command."""

from __future__ import annotations

import click

from backfill.cli import LazyGroup

BENCHMARKS: dict[str, tuple[str, str]] = {
    "ingest": ("backfill.bench.ingest:ingest_command", "Upload + validate a 200 MB batch file."),
    "engine-sim": ("router.fleet.bench:bench_engine_sim_command", "Requests/s of one simulator."),
    "processor": ("async_processor.bench:bench_processor_command", "Messages/s through one processor."),
    "end-to-end": ("backfill.bench.end_to_end:end_to_end_command",
                   "A 50,000-request batch through the stack vs the fleet's capacity."),
    "prefix": ("router.bench.prefix:prefix_command",
               "Captured prefix reuse and TTFT: ours vs round-robin, vllm-router, sglang-router."),
    "isolation": ("backfill.bench.isolation:isolation_command",
                  "Interactive TTFT alone vs with a 10,000-request batch backlog; batch vs spare capacity."),
    "router-overhead": ("router.bench.overhead:router_overhead_command",
                        "Decision time, added proxy latency and max requests/s: ours vs vllm-router."),
}


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench_group() -> None:
    """Run a benchmark (results are ratios measured side by side in one run)."""

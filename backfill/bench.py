"""``backfill bench NAME``: the benchmark group. Each name maps to a ``"module:command"`` string in
:mod:`lab.bench` and is imported only when run, so ``backfill bench --help`` imports nothing from
``lab``. What each benchmark measures: :mod:`lab.bench` and docs/benchmarks.md.
"""

from __future__ import annotations

import click

from backfill.cli import LazyGroup

BENCHMARKS: dict[str, tuple[str, str]] = {
    "ingest": ("lab.bench.ingest:ingest_command", "Upload + validate a 200 MB batch file."),
    "engine-sim": ("lab.bench.engine_sim:bench_engine_sim_command", "Requests/s of one simulator."),
    "engine-fit": ("lab.bench.engine_fit:engine_fit_command",
                   "Fit the twin's step model to a real engine's measured steps; print engine-sim flags."),
    "interference": ("lab.bench.interference:interference_command",
                     "A stream's token gaps during a 24k prefill; preemptions under KV pressure (model time)."),
    "pollution": ("lab.bench.pollution:pollution_command",
                  "Interactive prefix hit rate after a 10,000-request batch sweep, guard off vs on (model time)."),
    "processor": ("lab.bench.processor:bench_processor_command", "Messages/s through one processor."),
    "end-to-end": ("lab.bench.end_to_end:end_to_end_command",
                   "A 50,000-request batch through the stack vs the fleet's capacity."),
    "prefix": ("lab.bench.prefix:prefix_command",
               "Captured prefix reuse and TTFT: ours vs round-robin, vllm-router, sglang-router."),
    "isolation": ("lab.bench.isolation:isolation_command",
                  "Interactive TTFT alone vs with a 10,000-request batch backlog; batch vs spare capacity."),
    "frontier": ("lab.bench.frontier:frontier_command",
                 "Engine-level isolation frontier (model time): TTFT p99 ratio vs batch fraction per mechanism."),
    "mixed": ("lab.bench.mixed:mixed_command",
              "Interactive (queued, direct), small tenants, a shared-prefix batch: together vs each alone."),
    "router-overhead": ("lab.bench.router_overhead:router_overhead_command",
                        "Decision time, added proxy latency and max requests/s: ours vs vllm-router."),
    "sessions": ("lab.bench.sessions:sessions_command",
                 "Agent sessions beside a batch backlog: later turns' TTFT, turn priority off vs on."),
    "responses": ("lab.bench.responses:responses_command",
                  "Agent sessions via previous_response_id vs resending the history: bytes, TTFT, reuse."),
    "router-ha": ("lab.bench.router_ha:router_ha_command",
                  "Several precise routers on one fleet: index agreement, captured reuse with 1, 2, 4 routers."),
    "pd": ("lab.bench.pd:pd_command",
           "Prefill/decode disaggregation vs aggregated, equal engine count: ITL p99, TTFT, throughput per P:D split."),
    "slots": ("lab.bench.slots:slots_command",
              "Batch on --max-num-seqs 8 engines vs the fleet's, before and after a router restart mid-batch."),
    "simulate-scale": ("lab.bench.simulate_scale:simulate_scale_command",
                       "The virtual-time fleet from 4 to 256 engines: decision cost, index memory, reuse, TTFT, isolation."),
}


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench_group() -> None:
    """Run a benchmark (results are ratios measured side by side in one run)."""

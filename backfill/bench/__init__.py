"""Benchmarks: ``backfill bench NAME``. Each prints a table and writes the same figures as JSON
(``--json PATH``); docs/benchmarks.md records the latest results with the exact command.

| module | job |
|---|---|
| ``ingest`` | ``backfill bench ingest``: upload + validate a large batch file (``batchfile`` writes it) |
| ``end_to_end`` | ``backfill bench end-to-end``: a batch through the whole stack vs the fleet's capacity |
| ``isolation`` | ``backfill bench isolation``: interactive TTFT alone vs beside a batch backlog |
| ``frontier`` | ``backfill bench frontier``: interactive TTFT p99 ratio vs batch fraction with and without each protection mechanism (one engine's core, model time) |
| ``mixed`` | ``backfill bench mixed``: queued and direct interactive, small tenants and a shared-prefix batch together vs each alone |
| ``processor`` | ``backfill bench processor``: messages/s through one async processor |
| ``engine_sim`` | ``backfill bench engine-sim``: requests/s of one engine simulator (``engine_twin``) |
| ``interference`` | ``backfill bench interference``: a stream's token gaps during a long prefill, preemptions under KV pressure (the twin's core, model time) |
| ``pollution`` | ``backfill bench pollution``: interactive prefix hit rate and TTFT after a 10,000-request batch sweep, cache-pollution guard off vs on (the twin's core, model time) |
| ``prefix`` | ``backfill bench prefix``: captured prefix reuse and TTFT, ours vs other routers |
| ``sessions`` | ``backfill bench sessions``: agent sessions beside a batch backlog, turn priority off vs on |
| ``router_overhead`` | ``backfill bench router-overhead``: decision time, added latency, requests/s |
| ``responses`` | ``backfill bench responses``: agent sessions via ``previous_response_id`` vs resending the history |
| ``router_ha`` | ``backfill bench router-ha``: several precise routers on one fleet (index agreement, reuse) |
| ``pd`` | ``backfill bench pd``: prefill/decode disaggregation vs aggregated at equal engine count (ITL, TTFT, throughput, every P:D split) |
| ``workloads`` | seeded traces (agentic sessions, llm-d shared-prefix groups, tool agents, a shared-prefix batch, long-context conversations), Mooncake-format traces, the oracle-reusable tokens |
| ``replay`` | async replayer: sessions closed-loop, arrivals open-loop, TTFT, cached tokens, captured reuse |
| ``launch`` | subprocess fleet of simulated engines and the routers (ours, ``vllm-router``, ``sglang-router``) |
| ``instant`` | an OpenAI-compatible server that answers at once, and a raw keep-alive load client |
| ``scheduling`` | ``python -m backfill.bench.scheduling``: the scheduler's decision time in process |
| ``kv_index`` | ``python -m backfill.bench.kv_index``: the KV block index's bytes per block and lookup time |

Goals and definitions of the router rows: shared/PERFORMANCE.md (``prefix`` and ``router-overhead``).
"""

from __future__ import annotations

import click

from backfill.cli import LazyGroup

BENCHMARKS: dict[str, tuple[str, str]] = {
    "ingest": ("backfill.bench.ingest:ingest_command", "Upload + validate a 200 MB batch file."),
    "engine-sim": ("backfill.bench.engine_sim:bench_engine_sim_command", "Requests/s of one simulator."),
    "interference": ("backfill.bench.interference:interference_command",
                     "A stream's token gaps during a 24k prefill; preemptions under KV pressure (model time)."),
    "pollution": ("backfill.bench.pollution:pollution_command",
                  "Interactive prefix hit rate after a 10,000-request batch sweep, guard off vs on (model time)."),
    "processor": ("backfill.bench.processor:bench_processor_command", "Messages/s through one processor."),
    "end-to-end": ("backfill.bench.end_to_end:end_to_end_command",
                   "A 50,000-request batch through the stack vs the fleet's capacity."),
    "prefix": ("backfill.bench.prefix:prefix_command",
               "Captured prefix reuse and TTFT: ours vs round-robin, vllm-router, sglang-router."),
    "isolation": ("backfill.bench.isolation:isolation_command",
                  "Interactive TTFT alone vs with a 10,000-request batch backlog; batch vs spare capacity."),
    "frontier": ("backfill.bench.frontier:frontier_command",
                 "Engine-level isolation frontier (model time): TTFT p99 ratio vs batch fraction per mechanism."),
    "mixed": ("backfill.bench.mixed:mixed_command",
              "Interactive (queued, direct), small tenants, a shared-prefix batch: together vs each alone."),
    "router-overhead": ("backfill.bench.router_overhead:router_overhead_command",
                        "Decision time, added proxy latency and max requests/s: ours vs vllm-router."),
    "sessions": ("backfill.bench.sessions:sessions_command",
                 "Agent sessions beside a batch backlog: later turns' TTFT, turn priority off vs on."),
    "responses": ("backfill.bench.responses:responses_command",
                  "Agent sessions via previous_response_id vs resending the history: bytes, TTFT, reuse."),
    "router-ha": ("backfill.bench.router_ha:router_ha_command",
                  "Several precise routers on one fleet: index agreement, captured reuse with 1, 2, 4 routers."),
    "pd": ("backfill.bench.pd:pd_command",
           "Prefill/decode disaggregation vs aggregated, equal engine count: ITL p99, TTFT, throughput per P:D split."),
}


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench_group() -> None:
    """Run a benchmark (results are ratios measured side by side in one run)."""

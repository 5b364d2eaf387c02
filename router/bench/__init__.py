"""Router benchmarks: ``backfill bench prefix`` and ``backfill bench router-overhead``.

| module | job |
|---|---|
| ``workloads`` | seeded traces (agentic sessions, llm-d shared-prefix groups) and the oracle-reusable tokens |
| ``replay`` | async replayer: sessions closed-loop, arrivals open-loop, TTFT, cached tokens, captured reuse |
| ``launch`` | subprocess fleet of simulated engines and the routers (ours, ``vllm-router``, ``sglang-router``) |
| ``instant`` | an OpenAI-compatible server that answers at once, and a raw keep-alive load client |
| ``prefix`` | ``backfill bench prefix`` |
| ``overhead`` | ``backfill bench router-overhead`` |

Goals and definitions: shared/PERFORMANCE.md (rows ``prefix`` and ``router-overhead``).
"""

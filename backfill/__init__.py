"""backfill: OpenAI-format batch jobs and queued LLM requests on the spare capacity of a vLLM fleet.

This package holds what spans the service packages: the ``backfill`` command line
(:mod:`backfill.cli`), the embedded PostgreSQL and Redis used when no URLs are given
(:mod:`backfill.stores`), the one-machine supervisor behind ``backfill up`` (:mod:`backfill.up`)
and the names of the benchmarks and the simulator, whose code is in :mod:`lab`.
"""

__version__ = "0.1.0"

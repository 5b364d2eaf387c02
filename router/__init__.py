"""OpenAI-compatible inference router in front of vLLM engines.

The vLLM engine simulator the tests and benchmarks put behind it is a separate package,
``engine_twin``; the router imports nothing from it.
"""

"""The engine twin: a vLLM engine simulator (``backfill engine-sim``), and the command lines of the
fleet's engines, simulated and real vLLM (``backfill engine``). See README.md in this folder.

It imports nothing from the services (``router``, ``batch_gateway``, ``workers``,
``async_processor``) nor from ``backfill``; only :mod:`common`.
"""

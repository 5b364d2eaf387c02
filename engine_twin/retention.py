"""A request's KV retention priority: the one rule the twin's server, the lab's model-time driver
and the benchmarks apply.

The rule (the cache-pollution guard, :mod:`engine_twin.kv_cache` module docstring): a request's
``kv_retention_priority`` when it sends one (0 … 100, TensorRT-LLM's ``KvCacheRetentionConfig``
range; :func:`engine_twin.protocol.kv_retention`); else the lowest, :data:`LOWEST_RETENTION` (0),
when its vLLM ``priority`` reaches the engine's ``--retention-priority-threshold`` (the fleet starts
its engines with :data:`engine_twin.launch.FLEET_RETENTION_PRIORITY_THRESHOLD`, so the batch band's
priority puts batch's own blocks at 0); else :data:`DEFAULT_RETENTION` (35). vLLM's block pool has
no per-request retention; this is the twin's extension (docs/engine-simulator.md).
"""

from __future__ import annotations

from engine_twin.kv_cache import DEFAULT_RETENTION, LOWEST_RETENTION


def request_retention(priority: int, threshold: int | None, kv_retention_priority: int | None = None) -> int:
    """The KV retention (0 … 100) of a request with vLLM ``priority`` (lower runs first) on an engine
    whose ``--retention-priority-threshold`` is ``threshold`` (None: off), given its
    ``kv_retention_priority`` (None when absent). Module docstring for the rule."""
    if kv_retention_priority is not None:
        return kv_retention_priority
    if threshold is not None and priority >= threshold:
        return LOWEST_RETENTION
    return DEFAULT_RETENTION

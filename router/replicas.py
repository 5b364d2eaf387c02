"""Several router replicas behind one Service: what each one's per-tenant limits are.

Flow control runs in each replica on its own (router/README.md, "Several replicas"): its queues,
its fair-share (DRR) accounting and its in-flight counts are per replica; the engines' saturation
it gates on is read from the engines, so every replica sees the same. Per-tenant limits are the
one thing a tenant could multiply by spreading its calls over replicas, so with ``replicas`` = N
each replica enforces ``ceil(limit / N)`` of a band's ``tenant_max_in_flight`` and
``tenant_max_queued`` (no shared store, no coordination on the request path). With the Service
spreading connections evenly the fleet-wide limit is about the configured one (at most
``N × ceil(limit / N)`` ≤ ``limit + N − 1``); a tenant whose calls land unevenly is limited
earlier on the busier replica, never later. Band-wide bounds (``max_in_flight``, queue sizes) stay
per replica: they size one replica's queues, and the engines' saturation bounds the fleet.
"""

from __future__ import annotations

from router.flow_control.config import FlowControlConfig


def per_replica_limit(limit: int | None, replicas: int) -> int | None:
    """``ceil(limit / replicas)`` (None stays None: no limit).

    Raises:
        ValueError: ``replicas`` below 1.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return None if limit is None else -(-limit // replicas)


def split_tenant_limits(config: FlowControlConfig, replicas: int) -> FlowControlConfig:
    """``config`` with every band's ``tenant_max_in_flight`` and ``tenant_max_queued`` divided by
    ``replicas`` (rounded up, see the module docstring); ``config`` itself for one replica.

    Raises:
        ValueError: ``replicas`` below 1.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if replicas == 1:
        return config
    bands = [band.model_copy(update={
        "tenant_max_in_flight": per_replica_limit(band.tenant_max_in_flight, replicas),
        "tenant_max_queued": per_replica_limit(band.tenant_max_queued, replicas)}) for band in config.bands]
    return config.model_copy(update={"bands": bands})

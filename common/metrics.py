"""The Prometheus registry every ``backfill`` service starts from: :func:`service_registry`.

Each service (gateway, worker, processor, router, engine simulator) owns its registry (no
process-global default registry); this one function gives it the same base:

- the standard runtime collectors of prometheus-client, as every Python exporter has them:
  ``process_*`` (CPU seconds, resident and virtual memory, open and maximum file descriptors, start
  time; Linux ``/proc``), ``python_info`` and ``python_gc_*`` (collections, objects collected,
  uncollectable objects per generation);
- no ``*_created`` series: prometheus-client exports, beside every counter, histogram and summary,
  a ``_created`` gauge holding the Unix time the series was made. Prometheus does not use it and
  it doubles the series count of a counter; :func:`prometheus_client.disable_created_metrics` turns it
  off. That switch is process-wide (prometheus-client reads it when it renders a sample), so
  every process that builds a registry here exports no ``_created`` series, from any registry.

``docs/observability.md`` ("Runtime series") lists what the collectors export.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)


def service_registry(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """``registry`` (a new :class:`CollectorRegistry` when None) with the ``process_*``,
    ``python_info`` and ``python_gc_*`` collectors registered, and ``_created`` series turned
    off for this process. Returns the registry. Raises ``ValueError`` (prometheus-client's
    duplicate-series error) when ``registry`` already has those collectors."""
    disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client leaves it unannotated
    registry = registry if registry is not None else CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry

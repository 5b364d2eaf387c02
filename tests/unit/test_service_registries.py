"""Every service's Prometheus registry has the runtime collectors (``process_*``, ``python_*``) and no
``*_created`` series (common.metrics.service_registry, docs/observability.md "Runtime series")."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from common.contracts.router_state import RouterState

RUNTIME = ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds", "python_info",
           "python_gc_collections_total")


def gateway_registry():
    from batch_gateway.metrics import GatewayMetrics

    return GatewayMetrics().registry


def worker_registry():
    from workers.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    metrics.tokens_collected("tenant_a", 3, 4)
    return metrics.registry


def worker_multiprocess_registry(tmp_path):
    from workers.metrics import multiprocess_registry

    return multiprocess_registry(str(tmp_path))


def engine_registry():
    from engine_twin.metrics import EngineMetrics
    from engine_twin.settings import EngineSimSettings

    return EngineMetrics(EngineSimSettings()).registry


def processor_registry():
    from async_processor.metrics import ProcessorMetrics

    return ProcessorMetrics().registry


def router_registry():
    from router.metrics import RouterMetrics

    return RouterMetrics(lambda: RouterState(pool_saturation=0.0, time=0.0)).registry


@pytest.mark.parametrize("build", [
    gateway_registry, worker_registry, engine_registry,
    processor_registry, router_registry,
])
def test_runtime_series_and_no_created_series(build):
    text = generate_latest(build()).decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert set(RUNTIME) <= names
    assert not [name for name in names if name.endswith("_created")]


def test_prefork_worker_registry_has_the_parents_runtime_series(tmp_path):
    text = generate_latest(worker_multiprocess_registry(tmp_path)).decode()
    assert "process_cpu_seconds_total" in text and "python_info" in text


def test_tenant_tokens_are_labelled_for_at_most_the_limit_of_tenants():
    from workers.metrics import OTHER_TENANT, TENANT_LABEL_LIMIT, WorkerMetrics

    metrics = WorkerMetrics()
    for index in range(TENANT_LABEL_LIMIT + 5):
        metrics.tokens_collected(f"tenant_{index}", 10, 1)
    metrics.tokens_collected("tenant_0", 10, 1)  # labelled before the limit: keeps its label
    metrics.tokens_collected(None, 7, 0)  # no tenant: other
    samples = [s for family in metrics.registry.collect() if family.name == "backfill_worker_tenant_tokens"
               for s in family.samples]
    tenants = {s.labels["tenant"] for s in samples}
    assert len(tenants) == TENANT_LABEL_LIMIT + 1 and OTHER_TENANT in tenants
    value = {(s.labels["tenant"], s.labels["kind"]): s.value for s in samples}
    assert value[("tenant_0", "prompt")] == 20 and value[("tenant_0", "completion")] == 2
    assert value[(OTHER_TENANT, "prompt")] == 5 * 10 + 7 and value[(OTHER_TENANT, "completion")] == 5

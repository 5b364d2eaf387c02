"""Router HA settings and wiring: --kv-events-connect specs, KV-event sources from Kubernetes
discovery (annotation or fixed port), per-tenant limits divided by --replicas, the KV-event
counters as a Prometheus series."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from common.contracts.router_state import RouterState
from router.cli import router_argv, router_command
from router.flow_control.config import FlowControlConfig
from router.kv_index.subscriber import KVEventSource
from router.metrics import RouterMetrics
from router.pool import (
    KV_EVENTS_PORT_ANNOTATION,
    KV_EVENTS_REPLAY_PORT_ANNOTATION,
    EndpointPool,
    KubernetesSource,
    ready_pod_kv_sources,
)
from router.replicas import per_replica_limit, split_tenant_limits
from router.settings import build_settings


def pod(ip: str | None, annotations: dict[str, str] | None = None, ready: str = "True") -> SimpleNamespace:
    status = SimpleNamespace(phase="Running", pod_ip=ip, conditions=[SimpleNamespace(type="Ready", status=ready)])
    return SimpleNamespace(status=status, metadata=SimpleNamespace(annotations=annotations))


def test_discovered_pods_kv_ports_come_from_their_annotation_else_the_fixed_port():
    pods = [pod("10.0.0.1"), pod("10.0.0.2", {KV_EVENTS_PORT_ANNOTATION: "6000"}),
            pod("10.0.0.3", {KV_EVENTS_PORT_ANNOTATION: "6000", KV_EVENTS_REPLAY_PORT_ANNOTATION: "7000"}),
            pod("10.0.0.4", {KV_EVENTS_PORT_ANNOTATION: "not-a-port"}), pod("10.0.0.5", ready="False"),
            pod("fd00::7")]
    assert ready_pod_kv_sources(pods, 8000, 5557) == [
        KVEventSource("http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        KVEventSource("http://10.0.0.2:8000", "tcp://10.0.0.2:6000", "tcp://10.0.0.2:6001"),
        KVEventSource("http://10.0.0.3:8000", "tcp://10.0.0.3:6000", "tcp://10.0.0.3:7000"),
        KVEventSource("http://10.0.0.4:8000", "tcp://10.0.0.4:5557", "tcp://10.0.0.4:5558"),
        KVEventSource("http://[fd00::7]:8000", "tcp://[fd00::7]:5557", "tcp://[fd00::7]:5558"),
    ]
    # no fixed port: only annotated pods; offset 0: no replay unless annotated
    assert [s.endpoint for s in ready_pod_kv_sources(pods, 8000, None)] == ["http://10.0.0.2:8000",
                                                                         "http://10.0.0.3:8000"]
    assert [s.replay for s in ready_pod_kv_sources(pods[1:3], 8000, None, 0)] == [None, "tcp://10.0.0.3:7000"]


def test_kubernetes_source_hands_the_kv_sources_of_each_list_to_the_subscriber():
    seen: list[list[KVEventSource]] = []

    async def scenario() -> set[str]:
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, health_interval_s=60, scrape_interval_s=60)
            source = KubernetesSource(pool, "app=vllm", 8000, namespace="llm", on_kv_sources=seen.append,
                                      kv_events_port=5557)
            source.apply([pod("10.0.0.1"), pod("10.0.0.2")])
            source.apply([pod("10.0.0.2")])
            names = set(pool.states)
            await pool.close()
            return names

    assert asyncio.run(scenario()) == {"http://10.0.0.2:8000"}
    assert [[s.endpoint for s in found] for found in seen] == [
        ["http://10.0.0.1:8000", "http://10.0.0.2:8000"], ["http://10.0.0.2:8000"]]


def test_tenant_limits_are_divided_by_the_replicas_rounding_up():
    assert [per_replica_limit(16, n) for n in (1, 2, 3, 16, 17)] == [16, 8, 6, 1, 1]
    assert per_replica_limit(None, 4) is None
    config = FlowControlConfig()
    assert split_tenant_limits(config, 1) is config
    split = split_tenant_limits(config, 3)
    for before, after in zip(config.bands, split.bands, strict=True):
        assert after.tenant_max_in_flight == per_replica_limit(before.tenant_max_in_flight, 3)
        assert after.tenant_max_queued == per_replica_limit(before.tenant_max_queued, 3)
        assert (after.max_in_flight, after.max_queued_requests) == (before.max_in_flight, before.max_queued_requests)
    assert split.band("interactive").tenant_max_in_flight == 6
    with pytest.raises(ValueError):
        split_tenant_limits(config, 0)


def test_kv_events_connect_settings_from_the_environment_and_the_command_line(monkeypatch):
    monkeypatch.setenv("BACKFILL_ROUTER_KV_EVENTS_CONNECT",
                       "http://a:8000=tcp://a:5557 http://b:8000=tcp://b:5557,tcp://b:6000")
    settings = build_settings()
    assert settings.kv_events_connect == ["http://a:8000=tcp://a:5557", "http://b:8000=tcp://b:5557,tcp://b:6000"]
    assert settings.kv_events and settings.replicas == 1
    with pytest.raises(ValidationError, match="ENGINE_URL"):
        build_settings(kv_events_connect=["tcp://a:5557"])
    monkeypatch.delenv("BACKFILL_ROUTER_KV_EVENTS_CONNECT")
    assert not build_settings().kv_events
    assert build_settings(engine_selector="app=vllm", kv_events_port=5557).kv_events
    assert not build_settings(engine_selector="app=vllm").kv_events


def test_router_argv_and_a_bad_spec_on_the_command_line():
    argv = router_argv(8100, ["http://a:8000"], kv_events_connect={"http://a:8000": "tcp://a:5557"}, replicas=2)
    assert argv[argv.index("--kv-events-connect") + 1] == "http://a:8000=tcp://a:5557"
    assert argv[argv.index("--replicas") + 1] == "2"
    result = CliRunner().invoke(router_command, ["--engine", "http://a:8000", "--kv-events-connect", "a=b"])
    assert result.exit_code == 2 and "ENGINE_URL" in result.output


def test_kv_event_counters_are_a_prometheus_series():
    events = {"messages": 10, "gaps": 3, "replays": 2, "replayed_batches": 5, "replay_failures": 1, "drops": 1,
              "restarts": 0}
    state = RouterState(pool_saturation=0.0, time=0.0, index={"kind": "kv-events", "tiers": {}, "events": events})
    text = RouterMetrics(lambda: state).render().decode()
    assert 'backfill_router_kv_events_total{kind="gaps"} 3.0' in text
    assert 'backfill_router_kv_events_total{kind="replays"} 2.0' in text
    assert 'backfill_router_kv_events_total{kind="drops"} 1.0' in text

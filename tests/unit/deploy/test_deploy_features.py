"""Every service gets the settings its features need, in Kubernetes and in Compose: a field left at
its default silently turns a feature off (the gateway without BACKFILL_ROUTER_URL shows "No router
is configured" on the dashboard's Lanes and Fleet pages). Settings are built the way each service
builds them, from its environment (the router's with ``router.settings.build_settings()``)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from compose_env import service_environment
from conftest import DEPLOY, OVERLAYS, STORE_FALLBACK, settings_under_env
from test_deploy_wiring import container_of, env_of, find

from async_processor.settings import ProcessorSettings
from batch_gateway.settings import GatewaySettings
from common.contracts.queue import (
    LLMD_REQUEST_CHANNEL,
    LLMD_REQUEST_SORTED_SET,
    LLMD_RESULT_CHANNEL,
    LLMD_RETRY_SORTED_SET,
    LLMD_TENANT_ATTRIBUTE,
)
from router.settings import build_settings
from workers.settings import WorkerSettings

#: expected value meaning "set to anything but the field's default"
SET = object()
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
COMPOSE_SHELL = {"BACKFILL_ADMIN_KEY": "compose-test-admin-key", "BACKFILL_ROUTER_TOKEN": "compose-test-router-token"}
#: the router honours fairness ids and objectives only from callers with its trusted token (router/trust.py)
TRUST = "the router honouring the processor's fairness ids and objectives"
LLMD = "llm-d-async's producers unchanged on their default names (docs/queue-producers.md)"
#: what a Redis processor needs to read llm-d-async's producers as backfill up does
LLMD_NEEDS: dict[str, tuple[str, Any]] = {
    "llmd_sorted_sets": (LLMD, [LLMD_REQUEST_SORTED_SET]), "llmd_retry_sorted_sets": (LLMD, [LLMD_RETRY_SORTED_SET]),
    "llmd_channels": (LLMD, [LLMD_REQUEST_CHANNEL]),
    "llmd_result_channel": (LLMD, LLMD_RESULT_CHANNEL), "llmd_lane": (LLMD, "async"),
    "tenant_attribute": (LLMD, LLMD_TENANT_ATTRIBUTE)}


def unmet(settings: Any, needs: dict[str, tuple[str, Any]]) -> list[str]:
    """The entries of ``needs`` (field -> (feature, expected value or SET)) that ``settings`` does
    not satisfy, as ``"field=value: feature"``."""
    out = []
    for field, (feature, expected) in needs.items():
        value = getattr(settings, field)
        if expected is SET:
            default = type(settings).model_fields[field].get_default(call_default_factory=True)
            ok = value not in (None, "", 0, []) and value != default
        else:
            ok = value == expected
        if not ok:
            out.append(f"{field}={value!r}: {feature}")
    return out


def pod_env(objects, deployment: str) -> dict[str, str]:
    """:func:`env_of` plus ``secretKeyRef`` variables: the rendered Secret's value, or a placeholder
    for a Secret the operator creates."""
    env = env_of(objects, deployment)
    for item in container_of(objects, deployment).get("env", []):
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            secret = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == ref["name"]]
            env[item["name"]] = (secret[0].get("stringData") or {}).get(ref["key"]) if secret else \
                f"<Secret {ref['name']}/{ref['key']}>"
    return env


def probe_port(objects, deployment: str) -> int:
    """The container port the readiness probe asks (a port name resolved)."""
    container = container_of(objects, deployment)
    port = container["readinessProbe"]["httpGet"]["port"]
    return next(p["containerPort"] for p in container["ports"] if port in (p["name"], p["containerPort"]))


def k8s_needs(objects) -> dict[str, tuple[Any, dict[str, tuple[str, Any]]]]:
    """Deployment -> (how its settings are built, the fields its features need)."""
    service = find(objects, "Service", "backfill-router")
    router_url = f"http://backfill-router:{next(p['port'] for p in service['spec']['ports'] if p['name'] == 'http')}"
    processor = {"router_url": ("dispatching lane requests to the router", router_url),
                 "metrics_port": ("the /health probes and the ServiceMonitor", SET),
                 "router_token": (TRUST, SET)}
    needs = {
        "backfill-gateway": (GatewaySettings, {
            "router_url": ("the dashboard's Lanes and Fleet pages", router_url),
            "admin_key": ("the admin dashboard and the scraped /metrics", SET),
            "s3_bucket": ("file bytes shared by every gateway and worker pod", SET)}),
        "backfill-worker": (WorkerSettings, {
            "metrics_port": ("the /health probes and the ServiceMonitor", probe_port(objects, "backfill-worker")),
            "s3_bucket": ("file bytes shared by every gateway and worker pod", SET)}),
        "backfill-processor": (ProcessorSettings, {
            **processor, **LLMD_NEEDS, "metrics_port": ("the /health probes", probe_port(objects, "backfill-processor"))}),
        "backfill-router": (build_settings, {
            "engine_selector": ("finding the vLLM pods", SET),
            "kv_events_port": ("every replica subscribing to every engine's KV events (precise routing)", SET),
            "host": ("answering the Service (not only the pod's loopback)", "0.0.0.0"),
            "trusted_token": (TRUST, SET)}),
    }
    if any(o["kind"] == "Deployment" and o["metadata"]["name"] == "backfill-processor-pubsub" for o in objects):
        # Pub/Sub: llm-d-async's attributes merged into metadata, its userid naming the tenant
        needs["backfill-processor-pubsub"] = (ProcessorSettings, {
            **processor, "tenant_attribute": (LLMD, LLMD_TENANT_ATTRIBUTE), "llmd_sorted_sets": (LLMD, [])})
    return needs


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kubernetes_service_gets_the_settings_its_features_need(rendered, overlay, monkeypatch):
    objects = rendered[overlay]
    problems = []
    for deployment, (build, needs) in k8s_needs(objects).items():
        settings = settings_under_env(build, {**STORE_FALLBACK, **pod_env(objects, deployment)}, monkeypatch)
        problems += [f"{deployment}: {p}" for p in unmet(settings, needs)]
    assert problems == []


def test_the_check_finds_a_gateway_without_the_router_url(rendered, monkeypatch):
    """What the manifests looked like before BACKFILL_ROUTER_URL was set: the check fails."""
    objects = rendered["dev"]
    env = {**STORE_FALLBACK, **pod_env(objects, "backfill-gateway")}
    del env["BACKFILL_ROUTER_URL"]
    build, needs = k8s_needs(objects)["backfill-gateway"]
    assert unmet(settings_under_env(build, env, monkeypatch), needs) == [
        "router_url=None: the dashboard's Lanes and Fleet pages"]


def compose_needs() -> dict[str, tuple[Any, dict[str, tuple[str, Any]]]]:
    """Compose service -> (how its settings are built, the fields its features need)."""
    router_port = service_environment(COMPOSE, "router", COMPOSE_SHELL)["BACKFILL_ROUTER_PORT"]
    router_url = f"http://router:{router_port}"
    engines = sorted(f"http://{name}:{s['command'][s['command'].index('--port') + 1]}"
                     for name, s in COMPOSE["services"].items() if s.get("command", [""])[0] == "engine-sim")
    return {
        "gateway": (GatewaySettings, {
            "router_url": ("the dashboard's Lanes and Fleet pages", router_url),
            "admin_key": ("the admin dashboard and /metrics", COMPOSE_SHELL["BACKFILL_ADMIN_KEY"])}),
        "worker": (WorkerSettings, {"metrics_port": ("the /health healthcheck", SET)}),
        "processor": (ProcessorSettings, {
            "router_url": ("dispatching lane requests to the router", router_url), **LLMD_NEEDS,
            "metrics_port": ("the /health healthcheck", SET), "router_token": (TRUST, SET)}),
        "router": (build_settings, {
            "engines": ("the engines to route to", engines),
            "host": ("answering the other containers", "0.0.0.0"), "trusted_token": (TRUST, SET)}),
    }


def test_every_compose_service_gets_the_settings_its_features_need(monkeypatch):
    problems = []
    for service, (build, needs) in compose_needs().items():
        settings = settings_under_env(build, service_environment(COMPOSE, service, COMPOSE_SHELL), monkeypatch)
        problems += [f"{service}: {p}" for p in unmet(settings, needs)]
    assert problems == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_processors_send_the_routers_trusted_token(rendered, overlay):
    objects = rendered[overlay]
    token = pod_env(objects, "backfill-router")["BACKFILL_ROUTER_TRUSTED_TOKEN"]
    processors = [o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"
                  and o["metadata"]["name"].startswith("backfill-processor")]
    assert processors and token
    assert {name: pod_env(objects, name)["BACKFILL_PROCESSOR_ROUTER_TOKEN"] for name in processors} == \
        {name: token for name in processors}


def test_the_compose_processor_sends_the_routers_trusted_token():
    router = service_environment(COMPOSE, "router", COMPOSE_SHELL)["BACKFILL_ROUTER_TRUSTED_TOKEN"]
    processor = service_environment(COMPOSE, "processor", COMPOSE_SHELL)["BACKFILL_PROCESSOR_ROUTER_TOKEN"]
    assert router == processor == COMPOSE_SHELL["BACKFILL_ROUTER_TOKEN"]

"""deploy/k8s/overlays/pd: prefill/decode disaggregation. Two vLLM pools whose pods carry
``llm-d.ai/role`` (prefill, decode) as the router's discovery reads it, one command line from
engine_twin/launch.py with vLLM's NixlConnector, the NIXL side channel on the pod IP at a declared
port, Deployments and PDBs that each own exactly one pool, and the routers on the P/D config."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import OVERLAYS, REPO
from test_deploy_manifests import _selected
from test_deploy_wiring import container_of, engine_kv_endpoints, find

from engine_twin.launch import pd_engine_env, vllm_engine_argv

POOLS = {"prefill": "backfill-vllm-prefill", "decode": "backfill-vllm"}
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
"""Both pools' connector: kv_both, as vLLM's NixlConnector guide runs both sides (the role of a
request comes from its kv_transfer_params)."""
ROLE_LABEL = "llm-d.ai/role"


@pytest.fixture
def pd(rendered) -> list[dict[str, Any]]:
    return rendered["pd"]


def _env(container) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def _template(objects, name: str) -> dict[str, Any]:
    return find(objects, "Deployment", name)["spec"]["template"]


def test_the_overlay_exists_with_two_pools(pd):
    assert "pd" in OVERLAYS
    deployments = {o["metadata"]["name"] for o in pd if o["kind"] == "Deployment"}
    assert set(POOLS.values()) <= deployments
    for role, name in POOLS.items():
        assert _template(pd, name)["metadata"]["labels"][ROLE_LABEL] == role
        assert find(pd, "Deployment", name)["spec"]["replicas"] >= 1


@pytest.mark.parametrize("role", list(POOLS))
def test_each_pool_runs_the_launch_builders_nixl_command_line(pd, role):
    container = container_of(pd, POOLS[role])
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    kv, replay = engine_kv_endpoints(pd)
    expected = vllm_engine_argv("$(MODEL)", port, ["$(SERVED_MODEL_NAME)"], kv, host="$(POD_IP)", python="python3",
                                kv_events_replay_endpoint=replay, pd_role="both", plugin=True)
    assert container["command"] + container["args"] == expected
    args = container["args"]
    assert json.loads(args[args.index("--kv-transfer-config") + 1]) == NIXL
    assert args.count("--kv-transfer-config") == 1  # one connector: the CPU tier's is not also there
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_both_pools_are_one_engine_but_for_their_role(pd):
    """The prefill pool is the decode pool's container (image, command line, env, probes, ports)."""
    prefill, decode = (container_of(pd, POOLS[r]) for r in ("prefill", "decode"))
    assert prefill == decode
    templates = [copy.deepcopy(_template(pd, POOLS[r])) for r in ("prefill", "decode")]
    for template in templates:
        del template["metadata"]["labels"][ROLE_LABEL]
    assert templates[0] == templates[1]


@pytest.mark.parametrize("role", list(POOLS))
def test_the_nixl_side_channel_is_the_pod_ip_on_a_declared_port(pd, role):
    container = container_of(pd, POOLS[role])
    env = _env(container)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == ports["nixl"]
    # the names and the port the launch builder's environment uses (vLLM's own, default 5600)
    built = pd_engine_env(ports["nixl"], "$(POD_IP)", base={})
    assert set(built) <= set(env) and built["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["UCX_TLS"]["value"] and env["UCX_NET_DEVICES"]["value"]
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_the_routers_discovery_reads_each_pools_role(pd):
    """The router's own label parser (router.pool.pod_role) on each pool's pod labels."""
    from router.pool import pod_role

    for role, name in POOLS.items():
        pod = SimpleNamespace(metadata=SimpleNamespace(labels=_template(pd, name)["metadata"]["labels"]))
        assert pod_role(pod) == role
    unlabelled = SimpleNamespace(metadata=SimpleNamespace(labels={"app.kubernetes.io/component": "vllm"}))
    assert pod_role(unlabelled) == "both"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_deployment_selects_another_deployments_pods(rendered, overlay):
    """Two Deployments whose selectors overlap fight over each other's pods (the decode pool's
    selector carries its role for this reason)."""
    deployments = [o for o in rendered[overlay] if o["kind"] == "Deployment"]
    for owner in deployments:
        for other in deployments:
            if other is not owner:
                labels = other["spec"]["template"]["metadata"]["labels"]
                assert not _selected(owner["spec"]["selector"], labels), \
                    (overlay, owner["metadata"]["name"], other["metadata"]["name"])


def test_the_check_finds_overlapping_selectors(pd):
    decode = copy.deepcopy(find(pd, "Deployment", POOLS["decode"]))
    del decode["spec"]["selector"]["matchLabels"][ROLE_LABEL]  # the base's selector
    assert _selected(decode["spec"]["selector"], _template(pd, POOLS["prefill"])["metadata"]["labels"])


def test_each_pool_has_its_own_disruption_budget(pd):
    for role, name in POOLS.items():
        labels = _template(pd, name)["metadata"]["labels"]
        budgets = [o for o in pd if o["kind"] == "PodDisruptionBudget" and _selected(o["spec"]["selector"], labels)]
        assert len(budgets) == 1 and budgets[0]["spec"]["maxUnavailable"] == 1, (role, budgets)
        other = _template(pd, POOLS["decode" if role == "prefill" else "prefill"])["metadata"]["labels"]
        assert not _selected(budgets[0]["spec"]["selector"], other)


def test_engine_metrics_keep_the_role(pd):
    monitor = find(pd, "ServiceMonitor", "backfill-vllm")
    assert ROLE_LABEL in monitor["spec"]["podTargetLabels"]
    service = find(pd, "Service", "backfill-vllm")
    for name in POOLS.values():  # the scraped Service reaches both pools
        assert _selected({"matchLabels": service["spec"]["selector"]}, _template(pd, name)["metadata"]["labels"])


def test_the_routers_run_the_pd_handler_with_the_kv_event_index(pd):
    """The mounted config builds the router's scheduler: the P/D profile handler deciding on the
    precise (KV-event) producer, both profiles, the threshold of the shipped pd-config.yaml."""
    import yaml

    from router.kv_index.index import KVBlockIndex
    from router.scheduling.config import build_scheduler, parse_config
    from router.scheduling.interfaces import PluginHandle

    data = find(pd, "ConfigMap", "backfill-config")["data"]
    name = data["BACKFILL_ROUTER_CONFIG"].rsplit("/", 1)[1]
    text = find(pd, "ConfigMap", "backfill-router-scheduling")["data"][name]
    handle = PluginHandle(prefix_index=KVBlockIndex())
    scheduler = build_scheduler(parse_config(text), handle)
    handler = scheduler.profile_handler
    assert handler is not None and set(scheduler.profiles) == {"decode", "prefill"}
    producer = handle.plugins[handler.params.prefix_plugin_name]
    assert producer.plugin_type == "precise-prefix-cache-producer"
    shipped = yaml.safe_load((REPO / "router" / "scheduling" / "pd-config.yaml").read_text())
    threshold = next(p for p in shipped["plugins"] if p["type"] == "pd-profile-handler")["parameters"]["threshold"]
    assert handler.params.threshold == threshold

"""deploy/k8s: every rendered object is valid for its API (strictly: no unknown field, required
fields present), custom resources match their CRD schemas, selectors, probes, ports and
references fit together, and every pod follows the security and resource rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes.client
import pytest
import yaml
from conftest import DEPLOY, OVERLAYS
from deploy_render import object_key, render
from kubernetes.client import ApiClient

BUILTIN_GROUPS = {"v1", "apps/v1", "batch/v1", "policy/v1", "rbac.authorization.k8s.io/v1"}
CRD_SCHEMAS = yaml.safe_load((Path(__file__).with_name("crd_schemas.yaml")).read_text())
#: Secrets the operator creates (deploy/README.md); the dev overlay ships development ones.
EXTERNAL_SECRETS = {"backfill-stores", "backfill-admin", "backfill-router-token", "backfill-s3", "backfill-hf"}
#: Containers whose image needs a writable root filesystem (see the comment in base/vllm.yaml; the pd
#: overlay's prefill pool runs the same image).
WRITABLE_ROOT = {("backfill-vllm", "vllm"), ("backfill-vllm-prefill", "vllm")}
#: Services that must keep serving through voluntary disruptions.
NEEDS_PDB = {"gateway", "router", "processor", "worker", "vllm"}


def all_objects(rendered) -> list[tuple[str, dict[str, Any]]]:
    return [(overlay, obj) for overlay, objects in rendered.items() for obj in objects]


def model_errors(data: Any, type_name: str, path: str) -> list[str]:
    """Differences between ``data`` and the kubernetes client's model ``type_name``: keys the model
    does not know (its ``attribute_map``), and values of the wrong JSON type, recursively."""
    if type_name == "object":
        return []
    if match := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(data, list):
            return [f"{path}: expected a list"]
        return [e for i, item in enumerate(data) for e in model_errors(item, match[1], f"{path}[{i}]")]
    if match := re.fullmatch(r"dict\[str, (.+)\]", type_name):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping"]
        return [e for key, value in data.items() for e in model_errors(value, match[1], f"{path}.{key}")]
    primitive = {"str": str, "int": int, "bool": bool, "float": (int, float)}.get(type_name)
    if primitive is not None:
        wrong = not isinstance(data, primitive) or (type_name == "int" and isinstance(data, bool))
        return [f"{path}: expected {type_name}, got {data!r}"] if wrong else []
    model = getattr(kubernetes.client.models, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected a {type_name} mapping"]
    by_json_name = {json_name: attr for attr, json_name in model.attribute_map.items()}
    errors = []
    for key, value in data.items():
        if key not in by_json_name:
            errors.append(f"{path}.{key}: not a field of {type_name}")
        else:
            errors += model_errors(value, model.openapi_types[by_json_name[key]], f"{path}.{key}")
    return errors


def model_name(obj: dict[str, Any]) -> str:
    version = obj["apiVersion"].rsplit("/", 1)[-1]
    return version.capitalize() + obj["kind"]


class _Response:
    def __init__(self, obj: dict[str, Any]):
        self.data = json.dumps(obj)


def test_overlays_exist_and_render(rendered):
    assert {"dev", "production", "pubsub"} <= set(OVERLAYS)
    for overlay in OVERLAYS:
        kinds = {obj["kind"] for obj in rendered[overlay]}
        assert {"Deployment", "Service", "PodDisruptionBudget", "Job", "ConfigMap", "Role"} <= kinds, overlay


def test_builtin_objects_match_the_kubernetes_models_strictly(rendered):
    client = ApiClient()
    checked = 0
    for overlay, obj in all_objects(rendered):
        if obj["apiVersion"] not in BUILTIN_GROUPS:
            continue
        name = model_name(obj)
        assert model_errors(obj, name, f"{overlay}:{obj['kind']}/{obj['metadata']['name']}") == []
        # deserializing runs the client's own validation: required fields, enums it knows
        client.deserialize(_Response(obj), name)
        checked += 1
    assert checked >= 3 * 25


def test_strict_model_check_rejects_unknown_and_mistyped_fields():
    deployment = render(DEPLOY / "k8s" / "base")
    gateway = next(o for o in deployment if o["kind"] == "Deployment" and o["metadata"]["name"] == "backfill-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGett"] = container["readinessProbe"].pop("httpGet")
    container["ports"][0]["containerPort"] = "8000"
    errors = model_errors(gateway, "V1Deployment", "gateway")
    assert any("httpGett: not a field of V1Probe" in e for e in errors)
    assert any("containerPort: expected int" in e for e in errors)
    del gateway["spec"]["selector"]
    with pytest.raises(ValueError, match="selector"):
        ApiClient().deserialize(_Response(gateway), "V1Deployment")


def test_custom_resources_match_their_crd_schemas(rendered):
    seen = set()
    for overlay, obj in all_objects(rendered):
        if obj["apiVersion"] in BUILTIN_GROUPS:
            continue
        assert obj["kind"] in CRD_SCHEMAS, f"{overlay}: no schema for {obj['kind']}"
        schema = {"definitions": CRD_SCHEMAS["definitions"], **CRD_SCHEMAS[obj["kind"]]}
        jsonschema.validate(obj, schema)
        seen.add(obj["kind"])
    assert seen == {"ScaledObject", "TriggerAuthentication", "ServiceMonitor", "PrometheusRule"}


def test_crd_schema_rejects_a_misspelt_trigger_field(rendered):
    scaled = next(o for o in rendered["production"] if o["kind"] == "ScaledObject")
    broken = json.loads(json.dumps(scaled))
    broken["spec"]["triggers"][0]["metadata"]["lagcount"] = "5"
    schema = {"definitions": CRD_SCHEMAS["definitions"], **CRD_SCHEMAS["ScaledObject"]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def _selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        ok = {"In": value in expr.get("values", []), "NotIn": value not in expr.get("values", []),
              "Exists": expr["key"] in labels, "DoesNotExist": expr["key"] not in labels}[op]
        if not ok:
            return False
    return True


def _workloads(objects):
    return [o for o in objects if o["kind"] in {"Deployment", "StatefulSet", "Job"}]


def _template_labels(workload) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def test_selectors_match_pod_template_labels(rendered):
    for overlay, objects in rendered.items():
        workloads = _workloads(objects)
        for w in workloads:
            if w["kind"] != "Job":
                assert _selected(w["spec"]["selector"], _template_labels(w)), (overlay, w["metadata"]["name"])
        pod_label_sets = [_template_labels(w) for w in workloads]
        for obj in objects:
            if obj["kind"] == "Service":
                selector = {"matchLabels": obj["spec"]["selector"]}
            elif obj["kind"] == "PodDisruptionBudget":
                selector = obj["spec"]["selector"]
            else:
                continue
            matched = [labels for labels in pod_label_sets if _selected(selector, labels)]
            assert matched, f"{overlay}: {obj['kind']}/{obj['metadata']['name']} selects no pod"
            # no selector spans two workloads (a PDB or Service over two components is a bug)
            assert len({labels["app.kubernetes.io/component"] for labels in matched}) == 1


def test_service_monitors_and_scaled_objects_reference_existing_objects(rendered):
    for overlay, objects in rendered.items():
        services = [o for o in objects if o["kind"] == "Service"]
        deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
        auths = {o["metadata"]["name"] for o in objects if o["kind"] == "TriggerAuthentication"}
        for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
            targets = [s for s in services if _selected(monitor["spec"]["selector"], s["metadata"]["labels"])]
            assert targets, f"{overlay}: ServiceMonitor {monitor['metadata']['name']} selects no Service"
            ports = {p["name"] for s in targets for p in s["spec"]["ports"]}
            for endpoint in monitor["spec"]["endpoints"]:
                assert endpoint["port"] in ports
        for scaled in (o for o in objects if o["kind"] == "ScaledObject"):
            assert scaled["spec"]["scaleTargetRef"]["name"] in deployments
            for trigger in scaled["spec"]["triggers"]:
                if "authenticationRef" in trigger:
                    assert trigger["authenticationRef"]["name"] in auths


def _containers(objects):
    for w in _workloads(objects):
        pod = w["spec"]["template"]["spec"]
        for container in pod["containers"]:
            yield w, pod, container


def _port_names_and_numbers(container) -> set[Any]:
    ports = container.get("ports", [])
    return {p["containerPort"] for p in ports} | {p["name"] for p in ports if "name" in p}


def test_every_long_running_container_has_probes_on_a_declared_port(rendered):
    for overlay, objects in rendered.items():
        for w, _pod, container in _containers(objects):
            where = f"{overlay}:{w['metadata']['name']}/{container['name']}"
            if w["kind"] == "Job":
                continue  # one-shot; bounded by activeDeadlineSeconds instead
            assert "readinessProbe" in container and "livenessProbe" in container, where
            for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = container.get(probe_name)
                if probe is None:
                    continue
                action = probe.get("httpGet") or probe.get("tcpSocket")
                if action is None:
                    assert probe["exec"]["command"], where
                    continue
                assert action["port"] in _port_names_and_numbers(container), f"{where} {probe_name}"


def test_service_target_ports_are_declared_by_the_selected_containers(rendered):
    for overlay, objects in rendered.items():
        for service in (o for o in objects if o["kind"] == "Service"):
            selector = {"matchLabels": service["spec"]["selector"]}
            containers = [c for w, _p, c in _containers(objects) if _selected(selector, _template_labels(w))]
            declared = set().union(*(_port_names_and_numbers(c) for c in containers))
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in declared, f"{overlay}: {service['metadata']['name']} {port}"


def test_pods_run_non_root_with_limits_and_no_privilege_escalation(rendered):
    for overlay, objects in rendered.items():
        for w, pod, container in _containers(objects):
            where = f"{overlay}:{w['metadata']['name']}/{container['name']}"
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], where
            writable = (w["metadata"]["name"], container["name"]) in WRITABLE_ROOT
            assert sc["readOnlyRootFilesystem"] is (not writable), where
            if not writable:  # Python needs a writable /tmp
                assert "/tmp" in {m["mountPath"] for m in container.get("volumeMounts", [])}, where
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), where
            if "nvidia.com/gpu" in container["resources"]["limits"]:  # GPU engines: memory guaranteed
                for key in ("memory", "nvidia.com/gpu"):  # (the pinned CPU KV tier must not be evicted)
                    assert container["resources"]["limits"][key] == container["resources"]["requests"][key], where


def test_only_the_router_gets_api_credentials(rendered):
    for overlay, objects in rendered.items():
        accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
        bindings = [o for o in objects if o["kind"] == "RoleBinding"]
        assert [s["name"] for b in bindings for s in b["subjects"]] == ["backfill-router"]
        for b in bindings:
            assert b["subjects"][0].get("namespace", "") == b["metadata"].get("namespace", "")
        role = next(o for o in objects if o["kind"] == "Role")
        assert {"pods"} <= {r for rule in role["rules"] for r in rule["resources"]}
        assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in role["rules"])
        for w, pod, _c in _containers(objects):
            account = pod["serviceAccountName"]
            assert account in accounts, (overlay, account)
            mounted = pod.get("automountServiceAccountToken", accounts[account].get("automountServiceAccountToken", True))
            assert mounted == (account in {"backfill-router", "backfill-pubsub"}), (overlay, w["metadata"]["name"])


def test_pod_disruption_budgets_cover_the_serving_components(rendered):
    for overlay in OVERLAYS:
        objects = rendered[overlay]
        covered = {o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
                   for o in objects if o["kind"] == "PodDisruptionBudget"}
        assert NEEDS_PDB <= covered, overlay
        for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
            assert pdb["spec"].get("maxUnavailable") == 1  # never blocks a drain at one replica


def test_beat_is_a_single_replica_recreated(rendered):
    for overlay in OVERLAYS:
        beat = next(o for o in rendered[overlay] if o["kind"] == "Deployment" and o["metadata"]["name"] == "backfill-beat")
        assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"] == {"type": "Recreate"}
        assert not any(o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "backfill-beat"
                       for o in rendered[overlay])


def test_every_referenced_config_and_secret_exists(rendered):
    for overlay in OVERLAYS:
        objects = rendered[overlay]
        config_maps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
        secrets = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
        for w, pod, container in _containers(objects):
            refs = [("ConfigMap", s["configMapRef"]) for s in container.get("envFrom", []) if "configMapRef" in s]
            refs += [("Secret", s["secretRef"]) for s in container.get("envFrom", []) if "secretRef" in s]
            for env in container.get("env", []):
                source = env.get("valueFrom", {})
                if "configMapKeyRef" in source:
                    refs.append(("ConfigMap", source["configMapKeyRef"]))
                if "secretKeyRef" in source:
                    refs.append(("Secret", source["secretKeyRef"]))
            refs += [("ConfigMap", v["configMap"]) for v in pod.get("volumes", []) if "configMap" in v]
            for kind, ref in refs:
                if kind == "ConfigMap":
                    assert ref["name"] in config_maps, (overlay, w["metadata"]["name"], ref)
                else:
                    assert ref["name"] in EXTERNAL_SECRETS | secrets, (overlay, w["metadata"]["name"], ref)
        if overlay == "dev":  # the dev overlay is self-contained
            assert {"backfill-stores", "backfill-admin"} <= secrets


def test_overlays_pin_images_and_set_a_namespace(rendered):
    for overlay in OVERLAYS:
        namespaces = {o["metadata"].get("namespace") for o in rendered[overlay] if o["kind"] != "Namespace"}
        assert len(namespaces) == 1 and None not in namespaces, overlay
        assert [o["metadata"]["name"] for o in rendered[overlay] if o["kind"] == "Namespace"] == list(namespaces)
        for _w, _pod, container in _containers(rendered[overlay]):
            assert ":" in container["image"].rsplit("/", 1)[-1], (overlay, container["image"])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed on this machine")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_agrees_with_kubectl_kustomize(rendered, overlay):
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    theirs = {object_key(o): o for o in yaml.safe_load_all(out) if o}
    mine = {object_key(o): o for o in rendered[overlay]}
    assert mine == theirs

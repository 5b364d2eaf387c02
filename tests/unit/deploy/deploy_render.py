"""A small Kustomize renderer for the tests of ``deploy/k8s`` (no kubectl needed).

It implements exactly the features the manifests use, with Kustomize's semantics:

- ``resources``: YAML files (every document) and directories holding a ``kustomization.yaml``
  (rendered recursively, as a unit);
- ``components`` (``kind: Component``): their resources are added, then their patches applied to
  everything accumulated so far;
- ``patches``: RFC 6902 JSON patches only (``path`` or inline ``patch``, YAML or JSON), applied to
  each resource matching ``target`` (``kind``, ``name``) with the ``jsonpatch`` library;
- ``namespace``: set on every namespaced object and on ServiceAccount subjects of role bindings;
- ``images``: ``newName`` / ``newTag`` / ``digest`` for ``image`` fields of pod templates;
- ``replicas``: ``spec.replicas`` of the named Deployment/StatefulSet.

Anything else in a kustomization (generators, strategic-merge patches, labels, name prefixes)
raises ``ValueError``, so a manifest change that needs more is noticed instead of mis-rendered.
``tests/unit/deploy/test_deploy_manifests.py`` compares this renderer with ``kubectl kustomize``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "namespace", "images", "replicas"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of ``path``."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization(directory: Path) -> dict[str, Any]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED_FIELDS
    if unknown:
        raise ValueError(f"{directory}: kustomization fields this renderer does not support: {sorted(unknown)}")
    return spec


def _resources(directory: Path, entries: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for entry in entries:
        target = (directory / entry).resolve()
        out += render(target) if target.is_dir() else load_yaml_documents(target)
    return out


def _patch_operations(directory: Path, patch: dict[str, Any]) -> list[dict[str, Any]]:
    text = (directory / patch["path"]).read_text() if "path" in patch else patch["patch"]
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise ValueError(f"{directory}: only JSON6902 patches (a list of operations) are supported")
    return operations


def _matches(resource: dict[str, Any], target: dict[str, Any]) -> bool:
    unknown = set(target) - {"kind", "name"}
    if unknown:
        raise ValueError(f"patch target fields not supported: {sorted(unknown)}")
    return all(resource.get("kind") == target["kind"] if key == "kind" else resource["metadata"]["name"] == target["name"]
               for key in target)


def _apply_patches(directory: Path, patches: list[dict[str, Any]], resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for patch in patches:
        operations = _patch_operations(directory, patch)
        hits = [i for i, resource in enumerate(resources) if _matches(resource, patch["target"])]
        if not hits:
            raise ValueError(f"{directory}: patch target {patch['target']} matches nothing")
        for i in hits:
            resources[i] = jsonpatch.apply_patch(resources[i], operations)
    return resources


def _pod_specs(resource: dict[str, Any]) -> list[dict[str, Any]]:
    if resource.get("kind") in POD_TEMPLATE_KINDS:
        return [resource["spec"]["template"]["spec"]]
    return []


def _set_image(image: str, rules: list[dict[str, Any]]) -> str:
    name, tag = image, None
    if "@" in name:
        name = name.split("@", 1)[0]
    elif ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    for rule in rules:
        if rule["name"] != name:
            continue
        new_name = rule.get("newName", name)
        if "digest" in rule:
            return f"{new_name}@{rule['digest']}"
        new_tag = rule.get("newTag", tag)
        return f"{new_name}:{new_tag}" if new_tag else new_name
    return image


def _transform(spec: dict[str, Any], resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    namespace = spec.get("namespace")
    for resource in resources:
        if namespace and resource["kind"] not in CLUSTER_SCOPED:
            resource["metadata"]["namespace"] = namespace
        if namespace and resource["kind"] in {"RoleBinding", "ClusterRoleBinding"}:
            for subject in resource.get("subjects", []):
                if subject.get("kind") == "ServiceAccount" and not subject.get("namespace"):
                    subject["namespace"] = namespace
        for pod in _pod_specs(resource):
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                container["image"] = _set_image(container["image"], spec.get("images", []))
        for rule in spec.get("replicas", []):
            if resource["kind"] in {"Deployment", "StatefulSet"} and resource["metadata"]["name"] == rule["name"]:
                resource["spec"]["replicas"] = rule["count"]
    return resources


def render(directory: Path) -> list[dict[str, Any]]:
    """Render the kustomization in ``directory`` into a list of objects (copies; order: resources
    as listed). Raises ``ValueError`` on a feature this renderer does not implement, a patch that
    matches nothing, or two objects with the same kind, namespace and name."""
    directory = Path(directory)
    spec = _kustomization(directory)
    resources = copy.deepcopy(_resources(directory, spec.get("resources", [])))
    for component in spec.get("components", []):
        component_dir = (directory / component).resolve()
        component_spec = _kustomization(component_dir)
        if component_spec.get("kind") != "Component":
            raise ValueError(f"{component_dir} is not a kustomize Component")
        resources += copy.deepcopy(_resources(component_dir, component_spec.get("resources", [])))
        resources = _apply_patches(component_dir, component_spec.get("patches", []), resources)
    resources = _apply_patches(directory, spec.get("patches", []), resources)
    resources = _transform(spec, resources)
    keys = [object_key(resource) for resource in resources]
    duplicates = {key for key in keys if keys.count(key) > 1}
    if duplicates:
        raise ValueError(f"{directory}: objects defined twice: {sorted(duplicates)}")
    return resources


def object_key(resource: dict[str, Any]) -> tuple[str, str, str, str]:
    """``(apiVersion, kind, namespace, name)`` of an object (namespace ``""`` when unset)."""
    meta = resource["metadata"]
    return resource["apiVersion"], resource["kind"], meta.get("namespace", ""), meta["name"]

"""Discovery: the pool's endpoints from Kubernetes pods matched by a label selector, with their roles
and KV-event sources (:class:`KubernetesSource`, and the pure readers of a pod list it uses).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from router.kv_index.subscriber import KVEventSource
from router.scheduling.types import ROLE_BOTH, ROLES

log = logging.getLogger(__name__)


class Membership(Protocol):
    """What discovery changes: the pool's endpoints (:meth:`router.pool.state.PoolState.set_endpoints`)."""

    def set_endpoints(self, urls: Iterable[str], roles: Mapping[str, str] | None = None) -> None:
        """Make the pool hold exactly ``urls`` with ``roles``."""


#: Pod annotations naming an engine's KV-event ports (router HA: every replica connects to them);
#: without them the router's ``kv_events_port`` setting and the replay port offset apply.
KV_EVENTS_PORT_ANNOTATION = "backfill.io/kv-events-port"
KV_EVENTS_REPLAY_PORT_ANNOTATION = "backfill.io/kv-events-replay-port"


class KubernetesSource:
    """Keeps a pool's endpoints equal to the Ready pods matching a label selector.

    Uses the official ``kubernetes`` client (``pip install kubernetes``; in-cluster credentials,
    else the local kubeconfig) and lists pods every ``interval_s`` seconds — a list rather than a
    watch keeps it simple and self-healing; engines come and go on a scale of minutes.

    Args:
        pool: the pool to update (its :meth:`~router.pool.state.PoolState.set_endpoints`).
        selector: label selector (``app.kubernetes.io/component=vllm``).
        port: engine port on each pod.
        namespace: namespace to list (default: the service account's namespace, else ``default``).
        interval_s: seconds between lists.
        static: URLs always kept in the pool besides the discovered ones.
        static_roles: role of each static URL that is not ``both`` (``--prefill-engine``,
            ``--decode-engine``); discovered pods take theirs from the :data:`ROLE_LABEL` label
            (:func:`pod_role`).
        on_kv_sources: called after each list with the KV-event sources of the Ready pods
            (:func:`ready_pod_kv_sources`); None: no KV events from discovery.
        kv_events_port: PUB port of pods without the :data:`KV_EVENTS_PORT_ANNOTATION` (None: such
            pods are not subscribed to).
        replay_port_offset: replay port = PUB port + this for pods without
            :data:`KV_EVENTS_REPLAY_PORT_ANNOTATION` (0: none).

    Raises:
        RuntimeError: the ``kubernetes`` package is not installed (raised by :meth:`start`).
    """

    NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

    def __init__(self, pool: Membership, selector: str, port: int, namespace: str | None = None,
                 interval_s: float = 5.0, static: Iterable[str] = (), *,
                 static_roles: Mapping[str, str] | None = None,
                 on_kv_sources: Callable[[list[KVEventSource]], None] | None = None,
                 kv_events_port: int | None = None, replay_port_offset: int = 1) -> None:
        self.pool = pool
        self.selector = selector
        self.port = port
        self.namespace = namespace
        self.interval_s = interval_s
        self.static = list(static)
        self.static_roles = dict(static_roles or {})
        self.on_kv_sources = on_kv_sources
        self.kv_events_port = kv_events_port
        self.replay_port_offset = replay_port_offset
        self._task: asyncio.Task | None = None

    @staticmethod
    def load_credentials() -> None:
        """Load the Kubernetes client's credentials: the pod's service account, else the
        kubeconfig (``KUBECONFIG``, ``~/.kube/config``).

        Raises:
            RuntimeError: the ``kubernetes`` package is missing, or neither source is usable
                (the message says which flag needs them).
        """
        try:
            from kubernetes import config
        except ImportError as exc:
            raise RuntimeError("engine discovery by label selector needs the kubernetes package "
                               "(pip install 'backfill[k8s]')") from exc
        try:
            config.load_incluster_config()
        except config.ConfigException as in_cluster:
            try:
                config.load_kube_config()
            except (config.ConfigException, OSError) as exc:
                raise RuntimeError(f"--engine-selector needs Kubernetes credentials: not in a pod ({in_cluster}) "
                                   f"and no usable kubeconfig ({exc})") from None

    def start(self) -> None:
        """Load credentials (:meth:`load_credentials`, which raises RuntimeError) and start
        listing pods in the background."""
        self.load_credentials()
        from kubernetes import client
        if self.namespace is None:
            try:
                with open(self.NAMESPACE_FILE) as fh:
                    self.namespace = fh.read().strip()
            except OSError:
                self.namespace = "default"
        api = client.CoreV1Api()
        self._task = asyncio.create_task(self._loop(api), name="kubernetes discovery")

    async def stop(self) -> None:
        """Stop listing."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self, api: Any) -> None:
        while True:
            try:
                pods = await asyncio.to_thread(api.list_namespaced_pod, self.namespace, label_selector=self.selector)
                self.apply(pods.items)
            except Exception:  # API unreachable: keep the last known set
                log.exception("listing engine pods failed")
            await asyncio.sleep(self.interval_s)

    def apply(self, pods: Iterable) -> None:
        """Make the pool (and the KV-event subscriber) follow one list of pods."""
        pods = list(pods)
        roles = {**self.static_roles, **ready_pod_roles(pods, self.port)}
        self.pool.set_endpoints([*self.static, *ready_pod_urls(pods, self.port)], roles)
        if self.on_kv_sources is not None:
            self.on_kv_sources(ready_pod_kv_sources(pods, self.port, self.kv_events_port, self.replay_port_offset))


def _ready_ip(pod) -> str | None:
    status = pod.status
    if status is None or status.phase != "Running" or not status.pod_ip:
        return None
    ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
    return status.pod_ip if ready else None


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


#: The pod label naming an engine's role in prefill/decode disaggregation (llm-d's ``RoleLabel``,
#: ``pkg/plugins/filter/pd_role.go``): ``prefill``, ``decode`` or ``both``; no label: ``both``.
ROLE_LABEL = "llm-d.ai/role"
#: Label values read as ``both``: llm-d's newer name for it (``RolePrefillDecode``), which its
#: prefill and decode filters both accept.
_BOTH_ALIASES = ("prefill-decode",)


def pod_role(pod) -> str | None:
    """The role of ``pod`` from its :data:`ROLE_LABEL` label: ``prefill``, ``decode``, ``both``
    (also for llm-d's ``prefill-decode`` and for a pod without the label); None for any other
    value, which neither llm-d's prefill filter nor its decode filter keeps (the pod is not routed
    to; :func:`ready_pod_urls` leaves it out and logs it)."""
    labels = getattr(getattr(pod, "metadata", None), "labels", None) or {}
    value = labels.get(ROLE_LABEL)
    if value is None:
        return ROLE_BOTH
    value = str(value).strip().lower()
    if value in ROLES:
        return value
    return ROLE_BOTH if value in _BOTH_ALIASES else None


def ready_pod_urls(pods: Iterable, port: int) -> list[str]:
    """``http://<pod IP>:<port>`` of each running pod whose ``Ready`` condition is true and whose
    role label is valid (:func:`pod_role`)."""
    out = []
    for pod in pods:
        ip = _ready_ip(pod)
        if not ip:
            continue
        if pod_role(pod) is None:
            log.warning("engine pod with an unknown role label left out", extra={
                "action": "router.pod_role_unknown", "pod_ip": ip,
                "role": (getattr(getattr(pod, "metadata", None), "labels", None) or {}).get(ROLE_LABEL)})
            continue
        out.append(f"http://{_host(ip)}:{port}")
    return out


def ready_pod_roles(pods: Iterable, port: int) -> dict[str, str]:
    """Base URL → role (:func:`pod_role`) of each Ready pod with a valid role label."""
    return {f"http://{_host(ip)}:{port}": role for pod in pods
            if (ip := _ready_ip(pod)) and (role := pod_role(pod)) is not None}


def ready_pod_kv_sources(pods: Iterable, port: int, kv_events_port: int | None,
                         replay_port_offset: int = 1) -> list[KVEventSource]:
    """The KV-event sources of the Ready pods: PUB ``tcp://<pod IP>:<kv port>`` where the kv port
    is the pod's :data:`KV_EVENTS_PORT_ANNOTATION`, else ``kv_events_port`` (pods with neither are
    left out, as are annotations that are not a port number); replay at the pod's
    :data:`KV_EVENTS_REPLAY_PORT_ANNOTATION`, else kv port + ``replay_port_offset`` (0: none).
    The endpoint is the pod's URL as :func:`ready_pod_urls` names it."""
    out = []
    for pod in pods:
        ip = _ready_ip(pod)
        if ip is None:
            continue
        metadata = getattr(pod, "metadata", None)
        annotations = (metadata.annotations if metadata is not None else None) or {}
        kv_port = _port(annotations.get(KV_EVENTS_PORT_ANNOTATION)) or kv_events_port
        if kv_port is None:
            continue
        replay_port = _port(annotations.get(KV_EVENTS_REPLAY_PORT_ANNOTATION))
        if replay_port is None and replay_port_offset:
            replay_port = kv_port + replay_port_offset
        host = _host(ip)
        out.append(KVEventSource(f"http://{host}:{port}", f"tcp://{host}:{kv_port}",
                                 f"tcp://{host}:{replay_port}" if replay_port else None))
    return out


def _port(value: object) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else None

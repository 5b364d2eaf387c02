"""The endpoint pool: which engines exist, whether they are healthy, their load. One job per module:

================================  ==================================================================
module                            job
================================  ==================================================================
:mod:`router.pool.state`          :class:`PoolState`: membership, health flags, candidates, the
                                  in-flight counters and EWMAs, the ``on_down`` hooks; no I/O (the
                                  fleet simulator uses it on its virtual clock)
:mod:`router.pool.slots`          learning each engine's sequence slots from its scrapes
:mod:`router.pool.engine_metrics` :class:`EngineMetrics`: what the router reads of vLLM's ``/metrics``
:mod:`router.pool.probes`         :class:`PoolProbes`: health checks and scrapes over HTTP, attached
                                  to a state; :class:`EndpointPool`: a state with its probes
:mod:`router.pool.discovery`      :class:`KubernetesSource`: endpoints and roles from pods
================================  ==================================================================

The way in: :func:`router.assembly.build_router` builds the :class:`PoolState` from the router's
settings; ``router/app.py`` attaches :class:`PoolProbes` (and discovery) to it.
"""

from router.pool.discovery import (
    KV_EVENTS_PORT_ANNOTATION,
    KV_EVENTS_REPLAY_PORT_ANNOTATION,
    ROLE_LABEL,
    KubernetesSource,
    pod_role,
    ready_pod_kv_sources,
    ready_pod_roles,
    ready_pod_urls,
)
from router.pool.engine_metrics import SCRAPED_SERIES, EngineMetrics, parse_engine_metrics
from router.pool.probes import EndpointPool, PoolProbes
from router.pool.slots import server_info_max_num_seqs, slots_source
from router.pool.state import EndpointState, InFlight, OnDown, PoolState

__all__ = [
    "KV_EVENTS_PORT_ANNOTATION",
    "KV_EVENTS_REPLAY_PORT_ANNOTATION",
    "ROLE_LABEL",
    "SCRAPED_SERIES",
    "EndpointPool",
    "EndpointState",
    "EngineMetrics",
    "InFlight",
    "KubernetesSource",
    "OnDown",
    "PoolProbes",
    "PoolState",
    "parse_engine_metrics",
    "pod_role",
    "ready_pod_kv_sources",
    "ready_pod_roles",
    "ready_pod_urls",
    "server_info_max_num_seqs",
    "slots_source",
]

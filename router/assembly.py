"""One router assembly: :func:`build_router` builds the router's parts from its settings and a clock.

The parts are the router without I/O — the pool's state, the KV-event index, the scheduler, flow
control, the director and the saturation reads (:class:`RouterParts`). Whoever runs them attaches
the I/O: ``router/app.py``'s lifespan adds the HTTP sessions, the pool's probes
(:class:`router.pool.probes.PoolProbes`), the Kubernetes discovery, the KV-event subscriber and the
proxy; the virtual-time fleet simulator adds none and drives the parts on its own clock.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.director import Director
from router.flow_control import FlowControlConfig, FlowController
from router.kv_index.index import KVBlockIndex
from router.observer import RouterObserver
from router.pool.state import PoolState
from router.replicas import split_tenant_limits
from router.runtime import RouterRuntime
from router.scheduling.config import build_scheduler, load_config
from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.session import working_set_of
from router.scheduling.scheduler import Scheduler
from router.settings import RouterSettings

log = logging.getLogger(__name__)

#: Tokens per block of the router's KV-event index (its own hashing, ``router/kv_index/index.py``).
INDEX_BLOCK_TOKENS = 64


@dataclass(frozen=True, slots=True)
class RouterParts:
    """The router without its I/O (:func:`build_router`).

    Attributes:
        settings: what it was built from.
        clock: monotonic seconds every part reads (the pool's stamps, the saturation reads, the
            plugins' TTLs, the index's speculative entries, the decision rate).
        pool: the pool's state (no probes attached).
        runtime: the saturation reads over ``pool`` and ``flow`` (flow control's gate, the
            ``spare-capacity-filter``, ``/admin/state``).
        scheduler: the scheduling profiles of the config in force.
        flow_config: the flow-control bands in force (objectives, priorities, sheddable ones).
        director: admission, scheduling and the forward decisions of every request.
        flow: the flow controller; None when ``settings.flow_control_enabled`` is False.
        index: the KV-event index (``precise-prefix-cache-producer``'s); None when not built.
    """

    settings: RouterSettings
    clock: Callable[[], float]
    pool: PoolState
    runtime: RouterRuntime
    scheduler: Scheduler
    flow_config: FlowControlConfig
    director: Director
    flow: FlowController | None
    index: KVBlockIndex | None

    def plugins(self) -> list[object]:
        """Every plugin instance of the scheduler, each once (:func:`scheduler_plugins`)."""
        return scheduler_plugins(self.scheduler)


def scheduler_plugins(scheduler: Scheduler) -> list[object]:
    """Every plugin instance of ``scheduler``'s profiles, each once, the profiles' hooks included
    (a P/D handler adds its prefix producer to the decode profile's hooks)."""
    seen: dict[int, object] = {}
    for profile in scheduler.profiles.values():
        for plugin in (*profile.producers, *profile.filters, *(s for s, _ in profile.scorers), profile.picker,
                       *profile.pre_request_hooks, *profile.response_hooks):
            seen[id(plugin)] = plugin
    return list(seen.values())


def build_router(settings: RouterSettings, clock: Callable[[], float] = time.monotonic, *,
                 observer: RouterObserver, flow_config: FlowControlConfig | None = None,
                 kv_index: bool | None = None, rng: random.Random | None = None) -> RouterParts:
    """Build the router's parts from ``settings`` and ``clock``, wired to each other; no I/O.

    What it builds and from which settings: the pool's state (``max_num_seqs``,
    ``batch_prefill_window_s``); the KV-event index (``index_max_blocks``) when ``kv_index``
    (default: ``settings.kv_events``); the scheduler from ``settings.scheduling_config`` with the
    profile ``settings.profile`` (None: the config's P/D handler when it has one, else its first
    profile); flow control from ``flow_config`` or ``settings.flow_control`` (split across
    ``settings.replicas``), a :class:`~router.flow_control.FlowController` when
    ``settings.flow_control_enabled``; the director (``make_room``, ``evict_on_wait``). The pool's
    ``on_down`` hooks drop a gone endpoint from the plugins, the index and the director; the
    pool's changes kick flow control.

    Args:
        settings: the router's settings.
        clock: monotonic seconds for every part (default :func:`time.monotonic`; a simulation
            passes its virtual clock).
        observer: where the director reports (the app's :class:`router.metrics.RouterMetrics`).
        flow_config: the flow-control bands to use as given (None: from the settings).
        kv_index: build the KV-event index (None: when ``settings.kv_events``).
        rng: the plugins' random source (None: an unseeded ``random.Random``).

    Raises:
        router.scheduling.errors.ConfigError, OSError: a bad or unreadable scheduling config.
        ValueError: ``settings.profile`` is not in the config; a bad flow-control file.

    The virtual-time simulator uses it as the app does, without the I/O: settings with
    ``flow_control_enabled=False`` (it steps its own pure
    :class:`~router.flow_control.FlowControlCore`, then sets ``parts.runtime.flow`` to it so the
    saturation reads count what it released), its virtual clock, ``flow_config`` its bands,
    ``kv_index`` when its config is precise and a seeded ``rng``; it adds its engines with
    ``parts.pool.add(EndpointState(..., healthy=True, models=[model]))``, pushes scrapes through
    ``parts.pool.record_metrics``, feeds ``parts.index`` the engines' KV events, gates on
    ``parts.runtime.gate_saturation`` and decides with ``parts.director.decide`` and the rules of
    :mod:`router.decisions`.
    """
    flow: FlowController | None = None

    def kick() -> None:
        if flow is not None:
            flow.kick()

    pool = PoolState(clock=clock, on_change=kick, max_num_seqs=settings.max_num_seqs,
                     batch_prefill_window_s=settings.batch_prefill_window_s)
    runtime = RouterRuntime(settings, clock)
    runtime.pool = pool
    build_index = settings.kv_events if kv_index is None else kv_index
    index = KVBlockIndex(block_size_tokens=INDEX_BLOCK_TOKENS, max_blocks=settings.index_max_blocks,
                         clock=clock) if build_index else None
    scheduler = _scheduler(settings, PluginHandle(rng=rng or random.Random(), clock=clock, prefix_index=index,
                                                  saturation=runtime.scheduling_saturation))
    plugins = scheduler_plugins(scheduler)
    runtime.working_set = working_set_of(plugins)
    _forget_gone_endpoints(pool, plugins, index)
    bands = flow_config if flow_config is not None else _flow_config(settings)
    if settings.flow_control_enabled:
        flow = FlowController(bands, saturation=runtime.gate_saturation, clock=clock,
                              unreserved=runtime.unreserved_gate_saturation,
                              has_endpoints=lambda: bool(pool.candidates()))
    runtime.flow = flow
    director = Director(pool=pool, scheduler=scheduler, profile=settings.profile, flow=flow, observer=observer,
                        objective_priority={band.objective: band.priority for band in bands.bands},
                        default_objective=bands.default_objective,
                        sheddable_objectives=frozenset(band.objective for band in bands.bands if band.sheddable),
                        make_room=settings.make_room, evict_on_wait=settings.evict_on_wait, clock=clock)
    pool.add_on_down(director.endpoint_down)
    return RouterParts(settings=settings, clock=clock, pool=pool, runtime=runtime, scheduler=scheduler,
                       flow_config=bands, director=director, flow=flow, index=index)


def _scheduler(settings: RouterSettings, handle: PluginHandle) -> Scheduler:
    """The scheduler of ``settings.scheduling_config``, its profile checked.

    Raises:
        ValueError: ``settings.profile`` is not one of the config's profiles.
    """
    scheduler = build_scheduler(load_config(settings.scheduling_config), handle)
    if settings.profile is not None and settings.profile not in scheduler.profiles:
        raise ValueError(f"profile {settings.profile!r} is not in {settings.scheduling_config} "
                         f"(profiles: {', '.join(scheduler.profiles)})")
    if settings.prefill_engines and scheduler.profile_handler is None:
        log.warning("prefill engines are given but the scheduling config has no pd-profile-handler: they get "
                    "whole requests like any engine", extra={"action": "router.pd_without_handler",
                                                             "config": str(settings.scheduling_config)})
    return scheduler


def _forget_gone_endpoints(pool: PoolState, plugins: list[object], index: KVBlockIndex | None) -> None:
    """An endpoint that goes down is forgotten by the plugins that keep per-endpoint state and by
    the KV-event index."""
    for plugin in plugins:
        forget = getattr(plugin, "forget_endpoint", None)
        if forget is not None:
            pool.add_on_down(forget)
    if index is not None:
        pool.add_on_down(index.remove_endpoint)


def _flow_config(settings: RouterSettings) -> FlowControlConfig:
    """The flow-control bands of ``settings`` (its YAML, else the defaults), each tenant limit split
    across ``settings.replicas`` (:func:`router.replicas.split_tenant_limits`)."""
    config = FlowControlConfig.from_file(settings.flow_control) if settings.flow_control else FlowControlConfig()
    return split_tenant_limits(config, settings.replicas)

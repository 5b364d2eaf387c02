"""``create_app(settings)``: the router's aiohttp application and everything it owns.

Routes:

==============================  ==============================================================
``POST /v1/chat/completions``,  inference: :mod:`router.proxy` (transport) and :mod:`router.director`
``/v1/completions``,            (flow control → scheduling → forward)
``/v1/embeddings``
``/v1/responses`` (POST, GET,   the Responses API with the router's state (:mod:`router.responses`):
DELETE, ``…/input_items``)      inference as above, the input rebuilt from ``previous_response_id``
``GET /v1/models``              models served by healthy endpoints (OpenAI list shape)
``GET /health``                 200 ``{"status": "ok", …}`` with ≥ 1 healthy endpoint, else 503
``GET /admin/state``            the admin JSON (:func:`admin_state`); the async processor's
                                saturation gate reads ``gate_saturation`` from it
``GET /metrics``                Prometheus (:mod:`router.metrics`)
==============================  ==============================================================

A cleanup context owns the HTTP sessions, the endpoint pool's probes, the flow controller's
dispatch task, the KV-event subscriber and the Kubernetes discovery; nothing lives at module level.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from common.contracts.router_state import SATURATION_THRESHOLD, BandState, CacheBlocks, EndpointState, RouterState
from router.director import Director
from router.flow_control import FlowControlConfig, FlowController
from router.kv_index.index import KVBlockIndex
from router.kv_index.subscriber import KVEventSubscriber, parse_connect_spec
from router.metrics import RouterMetrics
from router.parsing import RESPONSES_PATH
from router.pool import EndpointPool, KubernetesSource
from router.proxy import Proxy, error_response
from router.replicas import split_tenant_limits
from router.responses import ResponsesAPI
from router.scheduling.config import build_scheduler, load_config
from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins.session import SessionWorkingSet, working_set_of
from router.scheduling.saturation import (
    SaturationThresholds,
    endpoint_reserve,
    endpoint_saturation,
    gate_saturation,
    pd_fleet_saturation,
    pd_gate_saturation,
    reserve_in_use,
)
from router.scheduling.scheduler import Scheduler
from router.scheduling.types import Endpoint
from router.settings import RouterSettings
from router.tokenizers import EngineTokenizer, PromptTokenizer, build_tokenizer
from router.trust import HeaderTrust, load_api_keys

log = logging.getLogger(__name__)

INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PROXY_KEY: web.AppKey[Proxy] = web.AppKey("proxy", Proxy)
RESPONSES_KEY: web.AppKey[ResponsesAPI] = web.AppKey("responses", ResponsesAPI)


class RouterRuntime:
    """What the admin page and metrics read: built in the cleanup context, kept on the app."""

    def __init__(self, settings: RouterSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock  # monotonic seconds of the saturation reads (a simulation injects its virtual clock)
        self.thresholds = SaturationThresholds(
            queue_threshold=settings.queue_threshold, kv_threshold=settings.kv_threshold,
            max_metrics_age_s=settings.max_metrics_age_s, in_flight_credit=True,
            slot_reserve_fraction=settings.slot_reserve_fraction, min_slot_reserve=settings.min_slot_reserve,
            reserve_from_arrivals=settings.reserve_from_arrivals, batch_prefill_share=settings.batch_prefill_share,
            max_num_batched_tokens=settings.max_num_batched_tokens)
        self.pool: EndpointPool | None = None
        self.scheduler: Scheduler | None = None
        self.flow: FlowController | None = None
        self.index: KVBlockIndex | None = None
        self.subscriber: KVEventSubscriber | None = None
        self.metrics: RouterMetrics | None = None
        self.director: Director | None = None
        self.proxy: Proxy | None = None
        #: endpoint name → idle sessions' tokens there (the session plugin's; None: no such plugin)
        self.working_set: Callable[[], Mapping[str, int]] | None = None

    def session_working_set(self) -> Mapping[str, int]:
        """Endpoint name → tokens of its recently active idle sessions
        (``router/scheduling/plugins/session.py``); empty without a session plugin."""
        return self.working_set() if self.working_set is not None else {}

    def _fleet_values(self, reserve: bool) -> tuple[list[Endpoint], list[float]]:
        """The healthy endpoints and their saturations, aligned (:meth:`endpoint_saturations`)."""
        assert self.pool is not None
        self.pool.expire_prefills()
        candidates = self.pool.candidates()
        pending = 0
        if self.flow is not None:
            pending = max(0, self.flow.in_flight_requests - sum(ep.in_flight_requests for ep in candidates))
        values = pd_fleet_saturation(candidates, self.clock(), self.thresholds, pending, reserve=reserve,
                                     working_set=self.session_working_set() if reserve else None)
        return candidates, values

    def endpoint_saturations(self, *, reserve: bool = True) -> dict[str, float]:
        """Every healthy endpoint's saturation for sheddable work now, by name: the detector's value
        from the last scrapes with the scrape-lag credit per endpoint and, once the endpoint's slot
        count is known, the slot reserve for non-sheddable work, and the requests flow control released
        whose handlers have not forwarded them yet (one dispatch step may release several before
        any reaches an engine) placed on the least saturated endpoints
        (:func:`router.scheduling.saturation.fleet_saturation`). Flow control's gate and
        ``/admin/state`` read this one computation, so the dashboard shows what the gate does; the
        ``spare-capacity-filter`` reads the same per-endpoint detector (:meth:`scheduling_saturation`).
        Sheddable values count the idle sessions' working set as used KV (:meth:`session_working_set`)."""
        candidates, values = self._fleet_values(reserve)
        return {ep.name: value for ep, value in zip(candidates, values)}

    def _gate(self, saturations: Mapping[str, float]) -> float:
        """The gate over ``saturations`` (name → value of the healthy endpoints): per pool for a
        prefill/decode fleet (:func:`router.scheduling.saturation.pd_gate_saturation`)."""
        assert self.pool is not None
        candidates = [ep for ep in self.pool.candidates() if ep.name in saturations]
        return pd_gate_saturation(candidates, [saturations[ep.name] for ep in candidates])

    def pool_gates(self, saturations: Mapping[str, float]) -> dict[str, float]:
        """Each pool's least saturated value, ``{"prefill": …, "decode": …}`` (prefill-capable:
        roles prefill and both; decode-capable: decode and both; 1.0 for an empty pool)."""
        assert self.pool is not None
        candidates = [ep for ep in self.pool.candidates() if ep.name in saturations]
        return {"prefill": gate_saturation([saturations[ep.name] for ep in candidates if ep.can_prefill]),
                "decode": gate_saturation([saturations[ep.name] for ep in candidates if ep.can_decode])}

    def saturation(self) -> float:
        """Pool saturation: the mean of :meth:`endpoint_saturations` (1.0 with no healthy
        endpoint), for the metric and the dashboard; the gate is :meth:`gate_saturation`."""
        values = self.endpoint_saturations()
        return sum(values.values()) / len(values) if values else 1.0

    def gate_saturation(self) -> float:
        """The least saturated healthy endpoint's saturation (1.0 when none is healthy): below 1.0
        some engine has room for sheddable work (per-engine spare capacity, not the pool's mean).
        Flow control dispatches on this value. For a prefill/decode fleet: per pool, room in both
        a prefill-capable and a decode-capable engine (:meth:`_gate`)."""
        return pd_gate_saturation(*self._fleet_values(True))  # = self._gate(self.endpoint_saturations())

    def unreserved_gate_saturation(self) -> float:
        """:meth:`gate_saturation` without the slot reserve (which is kept FOR non-sheddable work):
        what flow control gates interactive work on once it is past its band's bypass bound."""
        return pd_gate_saturation(*self._fleet_values(False))

    def scheduling_saturation(self, endpoint: Endpoint) -> float:
        """One endpoint's saturation with the scrape-lag credit, for the ``spare-capacity-filter``
        (the request being placed is already counted by its endpoint's in-flight counters once
        forwarded; pending ones are not placed here)."""
        if self.pool is not None:
            self.pool.expire_prefills()
        source = self.working_set
        if source is None:
            tokens = 0
        elif isinstance(source, SessionWorkingSet):
            tokens = source.tokens(endpoint.name)  # one entry, not the map over every endpoint
        else:
            tokens = source().get(endpoint.name, 0)
        return endpoint_saturation(endpoint, self.clock(), self.thresholds, working_set_tokens=tokens)

    def state(self) -> RouterState:
        """The admin state (see :func:`admin_state`)."""
        return admin_state(self)


def admin_state(rt: RouterRuntime) -> RouterState:
    """``GET /admin/state``: the contract :class:`common.contracts.router_state.RouterState`."""
    assert rt.pool is not None and rt.scheduler is not None and rt.director is not None
    now = time.monotonic()
    per_endpoint_blocks, index_info = _index_view(rt)
    saturations = rt.endpoint_saturations()
    working_set = rt.session_working_set()
    endpoints = []
    for state in rt.pool.states.values():
        ep, m = state.endpoint, state.metrics
        age = None if ep.metrics_updated_at is None else now - ep.metrics_updated_at
        saturation = saturations.get(ep.name) if state.healthy else None
        evictions, evicted_tokens = rt.metrics.evictions_of(ep.name) if rt.metrics is not None else ({}, 0)
        endpoints.append(EndpointState(
            name=ep.name, healthy=state.healthy, models=state.models,
            num_requests_waiting=ep.num_requests_waiting, num_requests_running=ep.num_requests_running,
            kv_cache_usage_perc=ep.kv_cache_usage_perc, in_flight_requests=ep.in_flight_requests,
            in_flight_uncached_tokens=ep.in_flight_uncached_tokens,
            idle_session_tokens=working_set.get(ep.name, 0),
            saturation=saturation,
            gate_open=saturation is not None and saturation < SATURATION_THRESHOLD,
            headroom=None if saturation is None else max(0.0, 1.0 - saturation),
            metrics_age_s=age, block_size=ep.block_size, num_gpu_blocks=ep.num_gpu_blocks,
            num_cpu_blocks=ep.num_cpu_blocks,
            cache_blocks=CacheBlocks(**per_endpoint_blocks.get(ep.name, {})),
            prefix_cache_hit_rate=_ratio(m.prefix_cache_hits, m.prefix_cache_queries),
            external_prefix_cache_hit_rate=_ratio(m.external_prefix_cache_hits, m.prefix_cache_queries),
            last_error=state.last_error,
            slot_reserve=endpoint_reserve(ep, now, rt.thresholds), reserve_in_use=reserve_in_use(ep, now, rt.thresholds),
            interactive_rate_per_s=ep.interactive_rate(now), batch_prefill_tokens=ep.in_flight_sheddable_prefill_tokens,
            num_preemptions=ep.num_preemptions, evictions=evictions, evicted_tokens=evicted_tokens,
            role=ep.role,
        ))
    bands = [BandState(**band) for band in rt.flow.stats()["bands"]] if rt.flow is not None else []
    return RouterState(
        pool_saturation=sum(saturations.values()) / len(saturations) if saturations else 1.0,
        gate_saturation=rt._gate(saturations), pool_gate_saturation=rt.pool_gates(saturations), time=time.time(),
        decisions_per_s=rt.director.decisions.rate(), profile=rt.director.profile or rt.scheduler.default_profile,
        tokenizer=rt.settings.tokenizer, endpoints=endpoints, bands=bands, index=index_info,
        disaggregation=rt.metrics.disaggregation_stats() if rt.metrics is not None else {},
    )


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _index_view(rt: RouterRuntime) -> tuple[dict[str, dict[str, int]], dict[str, Any]]:
    if rt.index is not None:
        stats = rt.index.stats()
        per = {name: {"gpu": v.get("gpu", 0), "cpu": v.get("cpu", 0), "disk": v.get("disk", 0)}
               for name, v in stats.get("endpoints", {}).items()}
        tiers = {t: sum(v[t] for v in per.values()) for t in ("gpu", "cpu", "disk")}
        events = rt.subscriber.stats() if rt.subscriber is not None else {}
        return per, {"kind": "kv-events", "tiers": tiers, **{k: v for k, v in stats.items() if k != "endpoints"},
                     "events": events}
    approx = _approx_producer(rt.scheduler)
    if approx is None or rt.pool is None:
        return {}, {"kind": None, "tiers": {}}
    per = {name: {"gpu": approx.blocks_held(name), "cpu": 0, "disk": 0} for name in rt.pool.states}
    return per, {"kind": "approximate", "tiers": {"gpu": sum(v["gpu"] for v in per.values())}}


def _plugins(scheduler: Scheduler | None) -> list[object]:
    if scheduler is None:
        return []
    seen: dict[int, object] = {}
    for profile in scheduler.profiles.values():
        for plugin in (*profile.producers, *profile.filters, *(s for s, _ in profile.scorers), profile.picker,
                       *profile.pre_request_hooks, *profile.response_hooks):  # hooks: a P/D handler's producer
            seen[id(plugin)] = plugin
    return list(seen.values())


def _approx_producer(scheduler: Scheduler | None) -> Any:  # a plugin with blocks_held (no shared type)
    for plugin in _plugins(scheduler):
        if hasattr(plugin, "blocks_held"):
            return plugin
    return None


def create_app(settings: RouterSettings) -> web.Application:
    """The router application; its cleanup context starts and stops everything it owns.

    Raises:
        router.scheduling.errors.ConfigError: the scheduling config is invalid (at startup).
    """
    app = web.Application(client_max_size=settings.max_body_bytes)
    rt = RouterRuntime(settings)
    app["runtime"] = rt
    app.cleanup_ctx.append(lambda a: _lifespan(a, rt))

    async def inference(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY_KEY].handle(request)

    async def models(request: web.Request) -> web.Response:
        assert rt.pool is not None
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "backfill"} for m in rt.pool.models()]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def health(request: web.Request) -> web.Response:
        healthy = len(rt.pool.candidates()) if rt.pool else 0
        status = 200 if healthy else 503
        return web.json_response({"status": "ok" if healthy else "no_healthy_endpoints",
                                  "healthy_endpoints": healthy}, status=status, dumps=_dumps)

    async def state(request: web.Request) -> web.Response:
        return web.Response(body=rt.state().model_dump_json(), content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        assert rt.metrics is not None
        body = rt.metrics.render()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def not_found(request: web.Request) -> web.Response:
        return error_response(404, f"Unknown path {request.path}", code="unknown_url")

    for path in INFERENCE_PATHS:
        if path != RESPONSES_PATH:
            app.router.add_post(path, inference)
    responses = app[RESPONSES_KEY] = ResponsesAPI(lambda: app[PROXY_KEY])
    responses.add_routes(app.router)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/admin/state", state)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


def build_trust(settings: RouterSettings) -> HeaderTrust:
    """The header trust decision of ``settings`` (``trusted_token``, ``api_keys``).

    Raises:
        ValueError, OSError: the API-key file is unreadable or malformed.
    """
    token = settings.trusted_token.get_secret_value() if settings.trusted_token is not None else None
    api_keys = load_api_keys(settings.api_keys) if settings.api_keys is not None else None
    if not token:
        log.warning("no trusted token (BACKFILL_ROUTER_TRUSTED_TOKEN): fairness id and objective headers are "
                    "ignored on every request", extra={"action": "router.no_trusted_token"})
    return HeaderTrust(token, api_keys)


def _first_model(pool: EndpointPool, name: str) -> str | None:
    """The first model of ``name``'s ``/v1/models`` (None while unread): the chain seed of a
    connected KV-event source whose topic names none."""
    state = pool.get(name)
    return state.models[0] if state is not None and state.models else None


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


async def _lifespan(app: web.Application, rt: RouterRuntime) -> AsyncIterator[None]:
    settings = rt.settings
    control = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    forward = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                                    auto_decompress=False)
    discovery = None
    tokenizer: PromptTokenizer | None = None

    def kick() -> None:
        if rt.flow is not None:
            rt.flow.kick()

    try:
        pool = rt.pool = EndpointPool(control, scrape_interval_s=settings.scrape_interval_s,
                                      health_interval_s=settings.health_interval_s,
                                      unhealthy_after=settings.unhealthy_after, on_change=kick,
                                      max_num_seqs=settings.max_num_seqs,
                                      batch_prefill_window_s=settings.batch_prefill_window_s)
        handle = PluginHandle(saturation=rt.scheduling_saturation)
        static_kv = [parse_connect_spec(spec, settings.kv_events_replay_port_offset)
                     for spec in settings.kv_events_connect]
        if settings.kv_events:
            rt.index = KVBlockIndex(block_size_tokens=64, max_blocks=settings.index_max_blocks)
            rt.subscriber = KVEventSubscriber(rt.index, bind=settings.kv_events_bind, sources=static_kv,
                                              model_of=lambda name: _first_model(pool, name),
                                              replay_timeout_s=settings.kv_events_replay_timeout_s, allow_empty=True)
            handle.prefix_index = rt.index
        scheduler = rt.scheduler = build_scheduler(load_config(settings.scheduling_config), handle)
        if settings.profile is not None and settings.profile not in scheduler.profiles:
            raise ValueError(f"profile {settings.profile!r} is not in {settings.scheduling_config} "
                             f"(profiles: {', '.join(scheduler.profiles)})")
        if settings.prefill_engines and scheduler.profile_handler is None:
            log.warning("prefill engines are given but the scheduling config has no pd-profile-handler: they get "
                        "whole requests like any engine", extra={"action": "router.pd_without_handler",
                                                                 "config": str(settings.scheduling_config)})
        rt.working_set = working_set_of(_plugins(scheduler))
        for plugin in _plugins(scheduler):
            forget = getattr(plugin, "forget_endpoint", None)
            if forget is not None:
                pool.add_on_down(forget)
        if rt.index is not None:
            pool.add_on_down(rt.index.remove_endpoint)
        if rt.subscriber is not None:
            pool.add_on_down(rt.subscriber.resync)  # an engine that comes back is relearnt from its replay
        flow_config = split_tenant_limits(FlowControlConfig.from_file(settings.flow_control) if settings.flow_control
                                          else FlowControlConfig(), settings.replicas)
        if settings.flow_control_enabled:
            rt.flow = FlowController(flow_config, saturation=rt.gate_saturation,
                                     unreserved=rt.unreserved_gate_saturation,
                                     has_endpoints=lambda: bool(pool.candidates()))
        objective_priority = {band.objective: band.priority for band in flow_config.bands}
        tokenizer_path = str(settings.tokenizer_path) if settings.tokenizer_path else None
        if settings.tokenizer == "engine":  # ask any healthy engine, whichever source found it
            tokenizer = EngineTokenizer(lambda: next((ep.name for ep in pool.candidates()), None))
        else:
            tokenizer = build_tokenizer(settings.tokenizer, tokenizer_path=tokenizer_path)
        metrics = rt.metrics = RouterMetrics(rt.state)
        director = rt.director = Director(pool=pool, scheduler=scheduler, profile=settings.profile, flow=rt.flow,
                                          observer=metrics, objective_priority=objective_priority,
                                          default_objective=flow_config.default_objective,
                                          sheddable_objectives=frozenset(
                                              band.objective for band in flow_config.bands if band.sheddable),
                                          make_room=settings.make_room, evict_on_wait=settings.evict_on_wait)
        rt.proxy = app[PROXY_KEY] = Proxy(director=director, tokenizer=tokenizer, session=forward, observer=metrics,
                                          engine_priority=settings.engine_priority,
                                          max_body_bytes=settings.max_body_bytes,
                                          request_timeout_s=settings.request_timeout_s,
                                          connect_timeout_s=settings.connect_timeout_s,
                                          request_timeout_per_token_s=settings.request_timeout_per_token_s,
                                          trust=build_trust(settings))
        pool.add_on_down(director.endpoint_down)
        app[RESPONSES_KEY].open(settings.state_redis_url, settings.responses_ttl_s)
        problem = await app[RESPONSES_KEY].check()
        if problem is not None:
            log.warning("responses state Redis is not answering (%s): stored responses fail with 503 "
                        "state_store_unavailable until it does", problem)
        for profile in scheduler.profiles.values():
            profile.plugin_timer = metrics.plugin_timing
        if rt.subscriber is not None:
            rt.subscriber.start()
        if rt.flow is not None:
            await rt.flow.start()
        pool.set_endpoints(settings.all_engines, settings.engine_roles)
        if settings.engine_selector:
            subscriber = rt.subscriber if settings.kv_events_port is not None else None
            discovery = KubernetesSource(
                pool, settings.engine_selector, settings.engine_port, settings.engine_namespace,
                static=settings.all_engines, static_roles=settings.engine_roles,
                kv_events_port=settings.kv_events_port,
                replay_port_offset=settings.kv_events_replay_port_offset,
                on_kv_sources=None if subscriber is None else lambda found: subscriber.set_sources([*static_kv, *found]))
            discovery.start()
        yield
    finally:
        if discovery is not None:
            await discovery.stop()
        if rt.pool is not None:
            await rt.pool.close()
        if rt.flow is not None:
            await rt.flow.stop()
        if rt.subscriber is not None:
            await rt.subscriber.stop()
        if tokenizer is not None:
            await tokenizer.aclose()
        await app[RESPONSES_KEY].aclose()
        await forward.close()
        await control.close()

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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from common.contracts.router_state import SATURATION_THRESHOLD, BandState, CacheBlocks, EndpointState, RouterState
from router.assembly import RouterParts, build_router
from router.kv_index.subscriber import KVEventSource, KVEventSubscriber, parse_connect_spec
from router.metrics import RouterMetrics
from router.parsing import RESPONSES_PATH
from router.pool import KubernetesSource, PoolProbes, PoolState, slots_source
from router.proxy import Proxy, error_response
from router.responses import ResponsesAPI
from router.runtime import RouterRuntime as RouterRuntime  # re-exported: where its readers import it from
from router.scheduling.saturation import endpoint_reserve, reserve_in_use
from router.settings import RouterSettings
from router.tokenizers import EngineTokenizer, PromptTokenizer, build_tokenizer
from router.trust import HeaderTrust, load_api_keys

log = logging.getLogger(__name__)

INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PROXY_KEY: web.AppKey[Proxy] = web.AppKey("proxy", Proxy)
RESPONSES_KEY: web.AppKey[ResponsesAPI] = web.AppKey("responses", ResponsesAPI)


@dataclass(frozen=True, slots=True)
class RunningRouter:
    """The router the app serves once its lifespan started: what ``/admin/state``, ``/metrics``,
    ``/health`` and ``/v1/models`` read.

    Attributes:
        parts: the assembly (:func:`router.assembly.build_router`).
        metrics: the Prometheus series (the director's observer).
        subscriber: the KV-event subscriber feeding ``parts.index``; None when there is no index.
    """

    parts: RouterParts
    metrics: RouterMetrics
    subscriber: KVEventSubscriber | None

    def state(self) -> RouterState:
        """The admin state (see :func:`admin_state`)."""
        return admin_state(self)


RUNNING_KEY: web.AppKey[RunningRouter] = web.AppKey("running", RunningRouter)


def admin_state(running: RunningRouter) -> RouterState:
    """``GET /admin/state``: the contract :class:`common.contracts.router_state.RouterState`."""
    parts, metrics = running.parts, running.metrics
    rt = parts.runtime
    now = parts.clock()
    per_endpoint_blocks, index_info = _index_view(running)
    saturations = rt.endpoint_saturations()
    working_set = rt.session_working_set()
    reserved = rt.reserved_working_set()
    reasons = rt.gate_reasons(saturations)
    endpoints = []
    for state in parts.pool.states.values():
        ep, m = state.endpoint, state.metrics
        age = None if ep.metrics_updated_at is None else now - ep.metrics_updated_at
        saturation = saturations.get(ep.name) if state.healthy else None
        evictions, evicted_tokens = metrics.evictions_of(ep.name)
        endpoints.append(EndpointState(
            name=ep.name, healthy=state.healthy, models=state.models,
            num_requests_waiting=ep.num_requests_waiting, num_requests_running=ep.num_requests_running,
            kv_cache_usage_perc=ep.kv_cache_usage_perc, in_flight_requests=ep.in_flight_requests,
            in_flight_uncached_tokens=ep.in_flight_uncached_tokens,
            idle_session_tokens=working_set.get(ep.name, 0), reserved_session_tokens=reserved.get(ep.name, 0),
            gate_reason=reasons.get(ep.name, "") if state.healthy else "",
            saturation=saturation,
            gate_open=saturation is not None and saturation < SATURATION_THRESHOLD,
            headroom=None if saturation is None else max(0.0, 1.0 - saturation),
            metrics_age_s=age, block_size=ep.block_size, num_gpu_blocks=ep.num_gpu_blocks,
            num_cpu_blocks=ep.num_cpu_blocks,
            cache_blocks=CacheBlocks(**per_endpoint_blocks.get(ep.name, {})),
            prefix_cache_hit_rate=_ratio(m.prefix_cache_hits, m.prefix_cache_queries),
            external_prefix_cache_hit_rate=_ratio(m.external_prefix_cache_hits, m.prefix_cache_queries),
            last_error=state.last_error, max_num_seqs=ep.slots, slots_source=slots_source(ep),
            slot_reserve=endpoint_reserve(ep, now, rt.thresholds), reserve_in_use=reserve_in_use(ep, now, rt.thresholds),
            interactive_rate_per_s=ep.interactive_rate(now), batch_prefill_tokens=ep.in_flight_sheddable_prefill_tokens,
            num_preemptions=ep.num_preemptions, evictions=evictions, evicted_tokens=evicted_tokens,
            role=ep.role,
        ))
    bands = [BandState(**band) for band in parts.flow.stats()["bands"]] if parts.flow is not None else []
    return RouterState(
        pool_saturation=sum(saturations.values()) / len(saturations) if saturations else 1.0,
        gate_saturation=rt.gate_over(saturations), gate_reason=rt.gate_reason_over(saturations, reasons),
        pool_gate_saturation=rt.pool_gates(saturations), time=time.time(),
        decisions_per_s=parts.director.decisions.rate(),
        profile=parts.director.profile or parts.scheduler.default_profile,
        tokenizer=parts.settings.tokenizer, endpoints=endpoints, bands=bands, index=index_info,
        disaggregation=metrics.disaggregation_stats(),
    )


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _index_view(running: RunningRouter) -> tuple[dict[str, dict[str, int]], dict[str, Any]]:
    parts = running.parts
    if parts.index is not None:
        stats = parts.index.stats()
        per = {name: {"gpu": v.get("gpu", 0), "cpu": v.get("cpu", 0), "disk": v.get("disk", 0)}
               for name, v in stats.get("endpoints", {}).items()}
        tiers = {t: sum(v[t] for v in per.values()) for t in ("gpu", "cpu", "disk")}
        events = running.subscriber.stats() if running.subscriber is not None else {}
        return per, {"kind": "kv-events", "tiers": tiers, **{k: v for k, v in stats.items() if k != "endpoints"},
                     "events": events}
    approx = _approx_producer(parts.plugins())
    if approx is None:
        return {}, {"kind": None, "tiers": {}}
    per = {name: {"gpu": approx.blocks_held(name), "cpu": 0, "disk": 0} for name in parts.pool.states}
    return per, {"kind": "approximate", "tiers": {"gpu": sum(v["gpu"] for v in per.values())}}


def _approx_producer(plugins: list[object]) -> Any:  # a plugin with blocks_held (no shared type)
    for plugin in plugins:
        if hasattr(plugin, "blocks_held"):
            return plugin
    return None


def create_app(settings: RouterSettings) -> web.Application:
    """The router application; its cleanup context starts and stops everything it owns.

    Raises:
        router.scheduling.errors.ConfigError: the scheduling config is invalid (at startup).
    """
    app = web.Application(client_max_size=settings.max_body_bytes)
    app.cleanup_ctx.append(lambda a: _lifespan(a, settings))

    async def inference(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY_KEY].handle(request)

    async def models(request: web.Request) -> web.Response:
        pool = request.app[RUNNING_KEY].parts.pool
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "backfill"} for m in pool.models()]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def health(request: web.Request) -> web.Response:
        healthy = len(request.app[RUNNING_KEY].parts.pool.candidates())
        status = 200 if healthy else 503
        return web.json_response({"status": "ok" if healthy else "no_healthy_endpoints",
                                  "healthy_endpoints": healthy}, status=status, dumps=_dumps)

    async def state(request: web.Request) -> web.Response:
        return web.Response(body=request.app[RUNNING_KEY].state().model_dump_json(), content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        body = request.app[RUNNING_KEY].metrics.render()
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


def _first_model(pool: PoolState, name: str) -> str | None:
    """The first model of ``name``'s ``/v1/models`` (None while unread): the chain seed of a
    connected KV-event source whose topic names none."""
    state = pool.get(name)
    return state.models[0] if state is not None and state.models else None


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


async def _lifespan(app: web.Application, settings: RouterSettings) -> AsyncIterator[None]:
    """Build the router (:func:`router.assembly.build_router`), attach its I/O — the pool's probes,
    the KV-event subscriber, the tokenizer, the proxy, the Responses store, the discovery — start
    it, and stop it all on the way out."""
    control = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    forward = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                                    auto_decompress=False)
    probes: PoolProbes | None = None
    running: RunningRouter | None = None
    discovery: KubernetesSource | None = None
    tokenizer: PromptTokenizer | None = None
    try:
        metrics = RouterMetrics(lambda: app[RUNNING_KEY].state())
        parts = build_router(settings, observer=metrics)
        probes = PoolProbes(parts.pool, control, scrape_interval_s=settings.scrape_interval_s,
                            health_interval_s=settings.health_interval_s, unhealthy_after=settings.unhealthy_after)
        static_kv = [parse_connect_spec(spec, settings.kv_events_replay_port_offset)
                     for spec in settings.kv_events_connect]
        running = app[RUNNING_KEY] = RunningRouter(parts, metrics, _kv_subscriber(settings, parts, static_kv))
        tokenizer = _tokenizer(settings, parts)
        app[PROXY_KEY] = Proxy(director=parts.director, tokenizer=tokenizer, session=forward, observer=metrics,
                               engine_priority=settings.engine_priority, max_body_bytes=settings.max_body_bytes,
                               request_timeout_s=settings.request_timeout_s,
                               connect_timeout_s=settings.connect_timeout_s,
                               request_timeout_per_token_s=settings.request_timeout_per_token_s,
                               trust=build_trust(settings))
        await _open_responses(app, settings)
        for profile in parts.scheduler.profiles.values():
            profile.plugin_timer = metrics.plugin_timing
        if running.subscriber is not None:
            running.subscriber.start()
        if parts.flow is not None:
            await parts.flow.start()
        parts.pool.set_endpoints(settings.all_engines, settings.engine_roles)
        discovery = _discovery(settings, parts, running.subscriber, static_kv)
        yield
    finally:
        await _stop(app, running, probes, discovery, tokenizer)
        await forward.close()
        await control.close()


def _kv_subscriber(settings: RouterSettings, parts: RouterParts,
                   static_kv: list[KVEventSource]) -> KVEventSubscriber | None:
    """The KV-event subscriber feeding ``parts.index`` (None without an index); an engine that
    comes back is relearnt from its replay (a pool ``on_down`` hook)."""
    if parts.index is None:
        return None
    pool = parts.pool
    subscriber = KVEventSubscriber(parts.index, bind=settings.kv_events_bind, sources=static_kv,
                                   model_of=lambda name: _first_model(pool, name),
                                   replay_timeout_s=settings.kv_events_replay_timeout_s, allow_empty=True)
    pool.add_on_down(subscriber.resync)
    return subscriber


def _tokenizer(settings: RouterSettings, parts: RouterParts) -> PromptTokenizer:
    """The prompt tokenizer of ``settings.tokenizer`` (``engine``: ask any healthy engine,
    whichever source found it)."""
    if settings.tokenizer == "engine":
        pool = parts.pool
        return EngineTokenizer(lambda: next((ep.name for ep in pool.candidates()), None))
    tokenizer_path = str(settings.tokenizer_path) if settings.tokenizer_path else None
    return build_tokenizer(settings.tokenizer, tokenizer_path=tokenizer_path)


async def _open_responses(app: web.Application, settings: RouterSettings) -> None:
    """Open the Responses API state store; an unanswering Redis is logged, not fatal."""
    app[RESPONSES_KEY].open(settings.state_redis_url, settings.responses_ttl_s)
    problem = await app[RESPONSES_KEY].check()
    if problem is not None:
        log.warning("responses state Redis is not answering (%s): stored responses fail with 503 "
                    "state_store_unavailable until it does", problem)


def _discovery(settings: RouterSettings, parts: RouterParts, subscriber: KVEventSubscriber | None,
               static_kv: list[KVEventSource]) -> KubernetesSource | None:
    """Start the Kubernetes discovery when ``settings.engine_selector`` is given (else None); it
    also tells the subscriber the discovered engines' KV-event sources when pods have a port."""
    if not settings.engine_selector:
        return None
    feed = subscriber if settings.kv_events_port is not None else None
    discovery = KubernetesSource(
        parts.pool, settings.engine_selector, settings.engine_port, settings.engine_namespace,
        static=settings.all_engines, static_roles=settings.engine_roles,
        kv_events_port=settings.kv_events_port,
        replay_port_offset=settings.kv_events_replay_port_offset,
        on_kv_sources=None if feed is None else lambda found: feed.set_sources([*static_kv, *found]))
    discovery.start()
    return discovery


async def _stop(app: web.Application, running: RunningRouter | None, probes: PoolProbes | None,
                discovery: KubernetesSource | None, tokenizer: PromptTokenizer | None) -> None:
    """Stop what the lifespan started, in order: discovery, probes, flow control, the subscriber,
    the tokenizer, the Responses store."""
    if discovery is not None:
        await discovery.stop()
    if probes is not None:
        await probes.close()
    if running is not None and running.parts.flow is not None:
        await running.parts.flow.stop()
    if running is not None and running.subscriber is not None:
        await running.subscriber.stop()
    if tokenizer is not None:
        await tokenizer.aclose()
    await app[RESPONSES_KEY].aclose()

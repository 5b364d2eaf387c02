"""The director's typed results and the pool's in-flight counters, without HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from director_fakes import Recorder

from common.contracts.errors import error_json
from router.director import NO_ENDPOINT, Admitted, Director, Rejected
from router.flow_control import DropReason, RequestDropped
from router.parsing import parse_request
from router.pool import EndpointPool
from router.scheduling import DEFAULT_CONFIG_PATH
from router.scheduling.config import build_scheduler, load_config

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def test_the_pool_owns_in_flight_counters_and_forgets_shares_from_before_a_reset() -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, health_interval_s=60, scrape_interval_s=60)
            pool.set_endpoints(["http://a:8000"])
            ep = pool.states["http://a:8000"].endpoint
            share = pool.started(ep, 100)
            other = pool.started(ep, 50)
            assert (ep.in_flight_requests, ep.in_flight_uncached_tokens) == (2, 150)
            pool.first_chunk(share)
            pool.first_chunk(share)  # idempotent
            assert (ep.in_flight_requests, ep.in_flight_uncached_tokens) == (2, 50)
            pool.finished(share)
            pool.finished(share)  # once
            assert (ep.in_flight_requests, ep.in_flight_uncached_tokens) == (1, 50)
            pool._down("http://a:8000")  # counters reset: the share taken before no longer counts
            fresh = pool.started(ep, 10)
            pool.finished(other)
            assert (ep.in_flight_requests, ep.in_flight_uncached_tokens) == (1, 10)
            pool.finished(fresh)
            assert (ep.in_flight_requests, ep.in_flight_uncached_tokens) == (0, 0)
            await pool.close()

    asyncio.run(scenario())


def test_the_director_refuses_without_endpoints_and_admits_without_flow_control() -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, health_interval_s=60, scrape_interval_s=60)
            observer = Recorder()
            director = Director(pool=pool, scheduler=build_scheduler(load_config(DEFAULT_CONFIG_PATH)),
                                profile=None, flow=None, observer=observer,
                                objective_priority={"interactive": 100}, default_objective="interactive")
            parsed = parse_request("/v1/chat/completions", CHAT, {})
            assert director.objective(parsed) == "interactive"
            assert director.precheck(parsed) is NO_ENDPOINT
            assert await director.admit(parsed, "interactive", 0.0) == Admitted()
            assert observer.calls == []

    asyncio.run(scenario())


def test_a_flow_control_drop_is_rejected_with_its_status_envelope_and_headers() -> None:
    drop = RequestDropped(DropReason.CAPACITY, "batch band: full", retry_after_s=2.5, status=503)
    rejected = Rejected.dropped(drop)
    assert (rejected.status, rejected.code, rejected.headers) == (503, "rejected-capacity", drop.headers())
    assert error_json(rejected.message, rejected.error_type, rejected.param, rejected.code) == orjson.dumps(drop.body())

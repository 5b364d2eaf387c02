"""The director's prefill/decode flow without HTTP: both legs in the pool's counters, the retry,
the fallback, a prefill engine going down mid-prefill, and an eviction while the prefill runs."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from router.director import EVICTED, Admitted, Attempt, Director, Interruption, PrefillAnswer, Rejected
from router.flow_control import FlowControlConfig, FlowController, FlowItem
from router.pool import EndpointPool
from router.scheduling import PD_CONFIG_PATH
from router.scheduling.config import build_scheduler, load_config
from router.scheduling.interfaces import PluginHandle
from router.scheduling.types import LLMRequest

P1, P2, D = "http://p1", "http://p2", "http://d"
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "x"}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, args))

    def of(self, name: str) -> list[tuple[object, ...]]:
        return [args for n, args in self.calls if n == name]


@dataclass
class Legs:
    """A PDForwarder whose prefill answers come from ``answers`` (per endpoint; a callable may
    wait), and whose decode leg records what it was told and waits for ``done``."""

    answers: dict[str, Callable[[], Awaitable[PrefillAnswer]]] = field(default_factory=dict)
    disaggregable: bool = True
    prefilled: list[str] = field(default_factory=list)
    decoded: list[tuple[str, dict[str, Any] | None]] = field(default_factory=list)
    params: dict[str, Any] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    in_prefill: asyncio.Event = field(default_factory=asyncio.Event)

    async def prefill(self, attempt: Attempt) -> PrefillAnswer:
        self.prefilled.append(attempt.endpoint.name)
        return await self.answers[attempt.endpoint.name]()

    def use_kv_transfer(self, params: dict[str, Any] | None) -> None:
        self.params = params

    async def send(self, attempt: Attempt, retry: bool) -> object:
        self.decoded.append((attempt.endpoint.name, self.params))
        await self.done.wait()
        return "answered"

    async def interrupted(self, attempt: Attempt, interruption: Interruption) -> object:
        return interruption

    def rejected(self, rejected: Rejected) -> object:
        return rejected


def ok() -> Callable[[], Awaitable[PrefillAnswer]]:
    async def answer() -> PrefillAnswer:
        return PrefillAnswer(dict(PARAMS), cached_tokens=0)
    return answer


def failing(reason: str) -> Callable[[], Awaitable[PrefillAnswer]]:
    async def answer() -> PrefillAnswer:
        return PrefillAnswer(None, reason)
    return answer


CANCELLED: list[str] = []


def blocked(started: asyncio.Event) -> Callable[[], Awaitable[PrefillAnswer]]:
    async def answer() -> PrefillAnswer:
        started.set()
        try:
            await asyncio.Event().wait()  # until cancelled
        except asyncio.CancelledError:
            CANCELLED.append("prefill")
            raise
        raise AssertionError("unreachable")
    return answer


@dataclass
class Rig:
    director: Director
    pool: EndpointPool
    flow: FlowController
    observer: Recorder

    def ep(self, name: str):
        return self.pool.states[name].endpoint


def scenario(body: Callable[[Rig], Awaitable[None]], prefill: tuple[str, ...] = (P1, P2)) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, health_interval_s=60, scrape_interval_s=60)
            pool.set_endpoints([*prefill, D], {**{p: "prefill" for p in prefill}, D: "decode"})
            await pool.close()  # no probes
            for state in pool.states.values():
                state.healthy = True
                state.endpoint.metrics_updated_at = 1e12  # fresh forever
            pool._rebuild()
            flow = FlowController(FlowControlConfig(), saturation=lambda: 0.0)
            await flow.start()
            observer = Recorder()
            scheduler = build_scheduler(load_config(PD_CONFIG_PATH), PluginHandle(rng=random.Random(3)))
            director = Director(pool=pool, scheduler=scheduler, profile=None, flow=flow, observer=observer,
                                objective_priority={"interactive": 100, "batch": -10}, default_objective="interactive",
                                sheddable_objectives=frozenset({"batch"}))
            try:
                await body(Rig(director, pool, flow, observer))
            finally:
                await flow.stop()

    asyncio.run(run())


def long_request(n: int = 1000) -> LLMRequest:
    return LLMRequest("r", "m", prompt_bytes=b"q" * (4 * n), priority=100)


async def admitted(rig: Rig, objective: str = "interactive") -> Admitted:
    return Admitted(await rig.flow.admit(FlowItem(request_id="r", fairness_id="", objective=objective,
                                                  byte_size=1)))


def test_both_legs_count_in_their_endpoints_until_they_end() -> None:
    async def body(rig: Rig) -> None:
        started = asyncio.Event()
        release = asyncio.Event()

        async def slow() -> PrefillAnswer:
            started.set()
            await release.wait()
            return PrefillAnswer(dict(PARAMS))

        legs = Legs({P1: slow, P2: slow})
        task = asyncio.create_task(rig.director.forward(long_request(), "interactive", await admitted(rig), legs))
        await started.wait()
        (prefill,) = legs.prefilled
        assert (rig.ep(prefill).in_flight_requests, rig.ep(prefill).in_flight_uncached_tokens) == (1, 1000)
        assert (rig.ep(D).in_flight_requests, rig.ep(D).in_flight_uncached_tokens) == (1, 0)  # its slot only
        release.set()
        while not legs.decoded:
            await asyncio.sleep(0)
        assert legs.decoded == [(D, PARAMS)]
        assert rig.ep(prefill).in_flight_requests == 0 and rig.ep(prefill).in_flight_uncached_tokens == 0
        assert rig.ep(D).in_flight_requests == 1
        legs.done.set()
        assert await task == "answered"
        assert rig.ep(D).in_flight_requests == 0
        assert rig.observer.of("pd_decision") == [("disaggregated",)]

    scenario(body)


def test_a_failed_prefill_retries_once_elsewhere_then_falls_back_with_the_prompt_on_the_decode_engine() -> None:
    async def body(rig: Rig) -> None:
        legs = Legs({P1: failing("status"), P2: failing("connect")})
        task = asyncio.create_task(rig.director.forward(long_request(), "interactive", await admitted(rig), legs))
        while not legs.decoded:
            await asyncio.sleep(0)
        assert sorted(legs.prefilled) == [P1, P2]
        assert legs.decoded == [(D, None)]  # the original request
        assert rig.ep(D).in_flight_uncached_tokens == 1000  # the decode engine computes the prompt now
        legs.done.set()
        assert await task == "answered"
        assert len(rig.observer.of("prefill_failed")) == 2 and rig.observer.of("prefill_retried") == [()]
        assert rig.observer.of("pd_fallback") == [(dict(zip([P1, P2], ["status", "connect"]))[legs.prefilled[1]],)]

    scenario(body)


def test_a_client_error_of_the_prefill_engine_is_not_retried() -> None:
    async def body(rig: Rig) -> None:
        legs = Legs({P1: failing("client_error"), P2: failing("client_error")})
        legs.done.set()
        assert await rig.director.forward(long_request(), "interactive", await admitted(rig), legs) == "answered"
        assert len(legs.prefilled) == 1 and legs.decoded == [(D, None)]
        assert rig.observer.of("pd_fallback") == [("client_error",)]

    scenario(body)


def test_a_prefill_engine_going_down_mid_prefill_moves_the_prefill_alone() -> None:
    async def body(rig: Rig) -> None:
        started = asyncio.Event()
        legs = Legs({P1: blocked(started), P2: blocked(started)})
        task = asyncio.create_task(rig.director.forward(long_request(), "interactive", await admitted(rig), legs))
        await started.wait()
        (first,) = legs.prefilled
        other = P2 if first == P1 else P1
        legs.answers[other] = ok()
        rig.director.endpoint_down(first)
        while not legs.decoded:
            await asyncio.sleep(0)
        assert legs.prefilled == [first, other] and legs.decoded == [(D, PARAMS)]
        assert rig.observer.of("prefill_failed") == [(first, "endpoint_down")]
        legs.done.set()
        assert await task == "answered"

    scenario(body)


def test_an_eviction_during_the_prefill_ends_the_request_and_its_prefill() -> None:
    async def body(rig: Rig) -> None:
        started = asyncio.Event()
        legs = Legs({P1: blocked(started), P2: blocked(started)})
        admission = await admitted(rig, "batch")
        batch = LLMRequest("b", "m", prompt_bytes=b"q" * 4000, priority=-10, sheddable=True)
        task = asyncio.create_task(rig.director.forward(batch, "batch", admission, legs))
        await started.wait()
        (prefill,) = legs.prefilled
        CANCELLED.clear()
        assert admission.admission is not None and rig.flow.evict(admission.admission)
        assert await asyncio.wait_for(task, 5) is EVICTED
        assert legs.decoded == []  # never decoded: no half answer
        assert CANCELLED == ["prefill"]  # the prefill leg was cancelled with it (its engine aborts it)
        assert rig.ep(prefill).in_flight_requests == 0 and rig.ep(D).in_flight_requests == 0
        assert rig.ep(D).in_flight_sheddable == 0 and rig.ep(prefill).in_flight_sheddable_prefill_tokens == 0
        assert rig.observer.of("pd_fallback") == [] and ("shed", ("batch", "evicted")) in rig.observer.calls

    scenario(body)


def test_a_short_prompt_and_a_non_generation_request_are_not_disaggregated() -> None:
    async def body(rig: Rig) -> None:
        legs = Legs()
        legs.done.set()
        assert await rig.director.forward(long_request(100), "interactive", await admitted(rig), legs) == "answered"
        legs.disaggregable = False
        assert await rig.director.forward(long_request(5000), "interactive", await admitted(rig), legs) == "answered"
        assert legs.prefilled == [] and legs.decoded == [(D, None), (D, None)]
        assert rig.observer.of("pd_decision") == [("below_threshold",), ("not_generation",)]

    scenario(body)

"""The director's make-room: a non-sheddable request bound for an endpoint with no free sequence
slot evicts the newest sheddable request of the lowest band running there, through flow control's
eviction path (the victim's client gets 429 ``evicted``), and nothing else is evicted."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
from director_fakes import Hold, Recorder

from router.director import EVICTED, Admitted, Director
from router.flow_control import FlowControlConfig, FlowController, FlowItem
from router.pool import EndpointPool
from router.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

A, B = "http://a:8000", "http://b:8000"
PRIORITY = {"interactive": 100, "async": 10, "batch": -10}


class Pick:
    """A scheduler that sends every request to the endpoint named ``target``."""

    def __init__(self) -> None:
        self.target = A

    def schedule(self, request: LLMRequest, endpoints: Sequence[Endpoint], profile: str | None = None
                 ) -> SchedulingResult:
        ep = next(e for e in endpoints if e.name == self.target)
        return SchedulingResult("default", ep, [ep], [0.0], {}, CycleState())

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        pass

    def response_complete(self, request: LLMRequest, result: SchedulingResult, cached: int | None) -> None:
        pass


@dataclass
class Rig:
    director: Director
    pool: EndpointPool
    flow: FlowController
    picker: Pick
    observer: Recorder
    hold: Hold
    clock: list[float]

    def endpoint(self, name: str) -> Endpoint:
        return self.pool.states[name].endpoint

    async def start(self, objective: str, target: str = A, prompt_tokens: int = 0
                    ) -> tuple[asyncio.Task[object], Admitted]:
        """Admit one request of ``objective`` and forward it to ``target``; returns once it is in flight."""
        admission = await self.flow.admit(FlowItem(request_id=f"{objective}-{len(self.observer.calls)}",
                                                   fairness_id="", objective=objective, byte_size=10))
        admitted = Admitted(admission)
        request = LLMRequest(request_id=admission.request_id, model="m", objective=objective,
                             priority=PRIORITY[objective], sheddable=objective != "interactive",
                             prompt_bytes=b"x" * (4 * prompt_tokens))
        self.picker.target = target
        self.clock[0] += 1.0  # each request starts later than the one before
        task = asyncio.create_task(self.director.forward(request, objective, admitted, self.hold))
        await asyncio.sleep(0)  # it schedules, counts itself in flight and awaits the transport
        return task, admitted

    def scraped(self, name: str, running: int) -> None:
        """The engine's last scrape shows ``running`` requests (and none waiting)."""
        ep = self.endpoint(name)
        ep.num_requests_running, ep.num_requests_waiting = running, 0


def scenario(body: Callable[[Rig], Awaitable[None]], *, make_room: bool = True, max_num_seqs: int | None = 4,
             evict_on_wait: bool = False, window_s: float = 0.25) -> None:
    async def run() -> None:
        clock = [0.0]
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, health_interval_s=60, scrape_interval_s=60, max_num_seqs=max_num_seqs,
                                clock=lambda: clock[0], batch_prefill_window_s=window_s)
            pool.set_endpoints([A, B])
            await pool.close()  # no probes: the test plays the scrapes
            for state in pool.states.values():
                state.healthy = True
            pool._rebuild()
            flow = FlowController(FlowControlConfig(), saturation=lambda: 0.0)
            await flow.start()
            observer = Recorder()
            picker = Pick()
            director = Director(pool=pool, scheduler=picker, profile=None, flow=flow,  # type: ignore[arg-type]
                                observer=observer, objective_priority=PRIORITY, default_objective="interactive",
                                sheddable_objectives=frozenset({"async", "batch"}), make_room=make_room,
                                evict_on_wait=evict_on_wait)
            rig = Rig(director, pool, flow, picker, observer, Hold(), clock)
            try:
                await body(rig)
            finally:
                rig.hold.done.set()
                await flow.stop()

    asyncio.run(run())


def _made_room(rig: Rig) -> list[tuple[object, ...]]:
    return [args for name, args in rig.observer.calls if name == "made_room"]


def test_the_newest_request_of_the_lowest_band_on_that_endpoint_is_evicted_for_interactive_work() -> None:
    async def body(rig: Rig) -> None:
        old_batch, _ = await rig.start("batch")
        new_batch, new_admitted = await rig.start("batch")
        async_a, _ = await rig.start("async")  # newer, but of a higher band
        async_b, _ = await rig.start("async")
        newest_on_b, _ = await rig.start("batch", target=B)  # the newest batch request, elsewhere
        rig.scraped(A, 4)
        rig.scraped(B, 1)
        interactive, _ = await rig.start("interactive")
        assert await asyncio.wait_for(new_batch, 5) is EVICTED  # its client gets 429 "evicted" with Retry-After
        assert new_admitted.admission is not None and new_admitted.admission.evicted is not None
        assert new_admitted.admission.evicted.reason == "evicted"
        assert _made_room(rig) == [(A,)]
        assert ("shed", ("batch", "evicted")) in rig.observer.calls
        bands = {b["objective"]: b for b in rig.flow.stats()["bands"]}
        assert bands["batch"]["shed_total"]["evicted"] == 1 and bands["async"]["shed_total"]["evicted"] == 0
        running = [old_batch, async_a, async_b, newest_on_b, interactive]
        assert not any(t.done() for t in running)
        assert rig.endpoint(A).in_flight_requests == 4 and rig.endpoint(A).in_flight_sheddable == 3
        rig.hold.done.set()
        assert await asyncio.gather(*running) == ["answered"] * 5

    scenario(body)


def test_at_most_one_request_is_evicted_per_interactive_request() -> None:
    async def body(rig: Rig) -> None:
        batch = [(await rig.start("batch"))[0] for _ in range(4)]
        rig.scraped(A, 4)
        await rig.start("interactive")
        await rig.start("interactive")  # the scrape still shows 4 running: another slot is needed
        assert len(_made_room(rig)) == 2
        assert await asyncio.wait_for(asyncio.gather(*batch[2:]), 5) == [EVICTED, EVICTED]  # the two newest
        assert not any(t.done() for t in batch[:2])

    scenario(body)


def test_nothing_is_evicted_with_a_free_slot() -> None:
    async def body(rig: Rig) -> None:
        batch = [(await rig.start("batch"))[0] for _ in range(3)]
        rig.scraped(A, 3)
        await rig.start("interactive")  # takes the fourth slot
        assert _made_room(rig) == [] and not any(t.done() for t in batch)
        await rig.start("interactive")  # not yet scraped, but counted: no slot left now
        assert len(_made_room(rig)) == 1

    scenario(body)


def test_nothing_is_evicted_when_a_request_ended_since_the_scrape() -> None:
    """The scrape still shows 4 running, but the router saw one of them end: a slot is free."""
    async def body(rig: Rig) -> None:
        batch = [(await rig.start("batch"))[0] for _ in range(3)]
        rig.scraped(A, 4)
        await rig.start("interactive")
        assert _made_room(rig) == [] and not any(t.done() for t in batch)

    scenario(body)


def test_nothing_is_evicted_while_the_slot_count_is_unknown() -> None:
    async def body(rig: Rig) -> None:
        batch = [(await rig.start("batch"))[0] for _ in range(4)]
        rig.scraped(A, 4)
        assert rig.endpoint(A).slots is None
        await rig.start("interactive")
        assert _made_room(rig) == [] and not any(t.done() for t in batch)

    scenario(body, max_num_seqs=None)


def test_a_sheddable_request_evicts_nothing_and_the_setting_turns_it_off() -> None:
    async def sheddable(rig: Rig) -> None:
        batch = [(await rig.start("batch"))[0] for _ in range(4)]
        rig.scraped(A, 4)
        await rig.start("async")  # higher band, but sheddable itself: it waits like any other
        assert _made_room(rig) == [] and not any(t.done() for t in batch)

    async def interactive(rig: Rig) -> None:
        batch = [(await rig.start("batch"))[0] for _ in range(4)]
        rig.scraped(A, 4)
        await rig.start("interactive")
        assert _made_room(rig) == [] and not any(t.done() for t in batch)

    scenario(sheddable)
    scenario(interactive, make_room=False)


def test_only_non_sheddable_requests_are_on_the_endpoint_nothing_is_evicted() -> None:
    async def body(rig: Rig) -> None:
        others = [(await rig.start("interactive"))[0] for _ in range(4)]
        rig.scraped(A, 4)
        await rig.start("interactive")
        assert _made_room(rig) == [] and not any(t.done() for t in others)

    scenario(body)


# ---- evict-and-resume when the interactive request would wait (evict_on_wait) -----------------


def _evicted(rig: Rig) -> list[tuple[object, ...]]:
    return [args for name, args in rig.observer.calls if name == "evicted"]


def test_with_evict_on_wait_a_free_slot_still_evicts_the_newest_batch_request_in_prefill() -> None:
    async def body(rig: Rig) -> None:
        old, _ = await rig.start("batch", prompt_tokens=300)
        new, _ = await rig.start("batch", prompt_tokens=200)  # 1 s later: both within the 10-s window
        rig.scraped(A, 2)
        assert rig.endpoint(A).in_flight_sheddable_prefill_tokens == 500
        await rig.start("interactive")
        assert await asyncio.wait_for(new, 5) is EVICTED and not old.done()
        # wasted-token estimate: its uncached prompt tokens at dispatch, no stream chunks relayed
        assert _evicted(rig) == [(A, "batch_prefill", 200)] and _made_room(rig) == []
        assert rig.endpoint(A).in_flight_sheddable_prefill_tokens == 300

    scenario(body, evict_on_wait=True, window_s=10.0)


def test_with_evict_on_wait_a_request_past_its_prefill_is_evicted_only_when_requests_wait() -> None:
    async def body(rig: Rig) -> None:
        batch = [(await rig.start("batch", prompt_tokens=100))[0] for _ in range(2)]
        rig.clock[0] += 5.0  # past the 0.25-s prefill window: no prefill in flight as the router counts
        rig.pool.expire_prefills()
        assert rig.endpoint(A).in_flight_sheddable_prefill_tokens == 0
        rig.scraped(A, 2)
        await rig.start("interactive")
        assert _evicted(rig) == [] and not any(t.done() for t in batch)
        rig.endpoint(A).num_requests_waiting = 1  # something waits on the engine now
        await rig.start("interactive")
        assert await asyncio.wait_for(batch[1], 5) is EVICTED and not batch[0].done()
        assert _evicted(rig) == [(A, "engine_queue", 100)]

    scenario(body, evict_on_wait=True)


def test_without_evict_on_wait_batch_in_prefill_is_left_alone_and_no_free_slot_is_counted_as_its_reason() -> None:
    async def body(rig: Rig) -> None:
        batch = [(await rig.start("batch", prompt_tokens=50))[0] for _ in range(3)]
        rig.scraped(A, 3)
        await rig.start("interactive")  # a free slot: nothing evicted though batch is in prefill
        assert _evicted(rig) == []
        await rig.start("interactive")  # no slot left: make room
        assert _evicted(rig) == [(A, "no_free_slot", 50)] and _made_room(rig) == [(A,)]
        assert await asyncio.wait_for(batch[2], 5) is EVICTED

    scenario(body, window_s=10.0)

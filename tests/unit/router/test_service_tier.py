"""OpenAI's flex processing at the router (``router/service_tier.py``): the flex band's admission
(spare room only, a bounded wait, then OpenAI's 429), ``service_tier`` kept from the engine and
written into the answer, every other tier unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from director_fakes import Recorder

from router.director import Admitted, Director, Rejected
from router.flow_control import DropReason, FlowControlConfig, FlowController, RequestDropped
from router.parsing import RequestError, engine_body, parse_request
from router.pool import EndpointPool
from router.scheduling import DEFAULT_CONFIG_PATH
from router.scheduling.config import build_scheduler, load_config
from router.service_tier import RESOURCE_UNAVAILABLE, FlexAnswer, flex_objective, flex_refusal

CHAT = "/v1/chat/completions"


def chat_body(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_the_engine_never_sees_flex_and_other_tiers_pass_unchanged() -> None:
    flex = parse_request(CHAT, chat_body(service_tier="flex"), {})
    assert flex.service_tier == "flex"
    assert "service_tier" not in orjson.loads(engine_body(flex))
    for tier in ("auto", "default", "priority"):
        parsed = parse_request(CHAT, chat_body(service_tier=tier), {})
        assert engine_body(parsed) == parsed.raw  # the client's bytes, field included
    assert parse_request(CHAT, chat_body(), {}).service_tier is None
    assert parse_request(CHAT, chat_body(service_tier=3), {}).service_tier is None  # not a tier: the engine's to judge
    responses = parse_request("/v1/responses", orjson.dumps({"model": "m", "input": "hi", "service_tier": "flex"}), {})
    assert orjson.loads(engine_body(responses)) == {"model": "m", "input": "hi"}


def test_a_flex_answer_says_flex_in_json_and_in_every_stream_event() -> None:
    flex = FlexAnswer()
    chat = orjson.loads(flex.answer(orjson.dumps({"object": "chat.completion", "choices": [], "service_tier": None})))
    assert chat["service_tier"] == "flex"
    response = orjson.loads(flex.answer(orjson.dumps({"object": "response", "service_tier": "auto"})))
    assert response["service_tier"] == "flex"
    assert flex.answer(b"not json") == b"not json"
    assert flex.answer(b'{"error": {"message": "x"}}') == b'{"error": {"message": "x"}}'  # not an answer object

    events = (b'data: {"object": "chat.completion.chunk", "choices": [{"delta": {"content": "a"}}]}\n\n'
              b'event: response.completed\ndata: {"type": "response.completed", "response": {"object": "response"}}'
              b'\n\ndata: [DONE]\n\n')

    async def split() -> AsyncIterator[bytes]:
        for i in range(0, len(events), 7):  # cut mid-event: events are rewritten whole
            yield events[i:i + 7]

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in flex.stream(split())])

    out = asyncio.run(collect()).split(b"\n\n")
    assert orjson.loads(out[0].removeprefix(b"data: "))["service_tier"] == "flex"
    assert out[1].startswith(b"event: response.completed\n")
    assert orjson.loads(out[1].split(b"\n")[1].removeprefix(b"data: "))["response"]["service_tier"] == "flex"
    assert out[2] == b"data: [DONE]"


def test_no_room_is_openais_429_and_other_drops_keep_flow_controls_answer() -> None:
    for reason in (DropReason.TTL_EXPIRED, DropReason.SATURATED, DropReason.CAPACITY, DropReason.QUOTA):
        refusal = flex_refusal(RequestDropped(reason, "flex band: x", retry_after_s=1), 600.0)
        assert refusal is not None and refusal[1] == RESOURCE_UNAVAILABLE and "within 600 s" in refusal[0]
    assert flex_refusal(RequestDropped(DropReason.EVICTED, "x", retry_after_s=1), 600.0) is None
    assert flex_refusal(RequestDropped(DropReason.SATURATED, "x", retry_after_s=1, status=503), 600.0) is None
    with pytest.raises(RequestError) as refused:
        flex_objective({"interactive": 100, "batch": -10})  # a config without a flex band: no other band serves it
    assert (refused.value.status, refused.value.param) == (400, "service_tier")


def _config(flex_wait_s: float) -> FlowControlConfig:
    bands = [b.model_copy(update={"ttl_s": flex_wait_s}) if b.objective == "flex" else b
             for b in FlowControlConfig().bands]
    return FlowControlConfig(bands=bands)


async def _until(condition, what: str) -> None:
    """Poll ``condition`` between event-loop turns (a bound on turns, not on time)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


def test_flex_waits_for_spare_room_is_served_when_it_comes_and_gets_429_when_it_does_not() -> None:
    async def scenario() -> None:
        now = [0.0]
        saturation = [2.0]  # no engine has room
        config = _config(flex_wait_s=5.0)
        flow = FlowController(config, lambda: saturation[0], clock=lambda: now[0])
        await flow.start()
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(session, health_interval_s=60, scrape_interval_s=60)
            director = Director(pool=pool, scheduler=build_scheduler(load_config(DEFAULT_CONFIG_PATH)),
                                profile=None, flow=flow, observer=Recorder(),
                                objective_priority={b.objective: b.priority for b in config.bands},
                                default_objective="interactive",
                                sheddable_objectives=frozenset(b.objective for b in config.bands if b.sheddable))
            flex = parse_request(CHAT, chat_body(service_tier="flex"), {})
            assert director.objective(flex) == "flex"
            # a trusted caller's objective (the processor's lane; an untrusted caller's is gone by
            # now) wins: its batch line asking for flex stays in the batch band, never parked here
            batch_line = parse_request(CHAT, chat_body(service_tier="flex"), {"x-llm-d-inference-objective": "batch"})
            assert director.objective(batch_line) == "batch"
            assert director.objective(parse_request(CHAT, chat_body(service_tier="auto"), {})) == "interactive"

            def flex_band() -> dict:
                return next(b for b in flow.stats()["bands"] if b["objective"] == "flex")

            held = asyncio.create_task(director.admit(flex, "flex", now[0]))
            await _until(lambda: flex_band()["queued_requests"] == 1, "the flex request held")
            # interactive work goes while flex waits: its bypass is untouched
            interactive = await director.admit(parse_request(CHAT, chat_body(), {}), "interactive", now[0])
            assert isinstance(interactive, Admitted) and interactive.admission is not None
            interactive.release()
            assert not held.done()

            now[0] = 5.5  # past the flex band's wait
            flow.kick()
            rejected = await held
            assert isinstance(rejected, Rejected)
            assert (rejected.status, rejected.code, rejected.error_type) == (429, RESOURCE_UNAVAILABLE, "rate_limit_error")
            assert rejected.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
            assert "within 5 s" in rejected.message

            waiting = asyncio.create_task(director.admit(flex, "flex", now[0]))
            await _until(lambda: flex_band()["queued_requests"] == 1, "the second flex request held")
            saturation[0] = 0.5  # an engine has room
            flow.kick()
            admitted = await waiting
            assert isinstance(admitted, Admitted) and admitted.admission is not None
            assert admitted.admission.band_name == "flex"
            admitted.release()
            await pool.close()
        await flow.stop()

    asyncio.run(scenario())

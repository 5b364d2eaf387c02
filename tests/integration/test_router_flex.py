"""OpenAI's flex processing through ``backfill router`` with the official ``openai`` client:
``service_tier="flex"`` is served from spare capacity and the answer says ``"flex"`` (JSON and
stream, Chat Completions, Completions and Responses); with no room anywhere the request is held
in the router's ``flex`` band for the band's bounded wait, interactive work goes meanwhile, and the
client then gets OpenAI's 429 ``resource_unavailable``; a flex request evicted while it runs (make
room) gets the same 429, never a 5xx or a hang."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import openai

from tests.integration.test_router_proxy import _aborted, _hog, chat
from tests.integration.test_router_proxy_make_room import (
    ENDLESS_TOKENS,
    _endpoint,
    _learn_the_slot_count,
    _stop,
    _wait_waiting,
)
from tests.router_stack import RouterStack
from tests.waiting import wait_for

#: The shipped bands with the flex wait cut to a few seconds (the default is 600 s).
FLEX_WAIT_S = 4
BANDS = f"""
bands:
- {{objective: interactive, priority: 100, ttl_s: 30, bypass_saturation: true, max_in_flight: 64}}
- {{objective: async, priority: 10, ttl_s: 0, sheddable: true}}
- {{objective: flex, priority: 0, ttl_s: {FLEX_WAIT_S}, sheddable: true}}
- {{objective: batch, priority: -10, ttl_s: 0, sheddable: true}}
"""
MESSAGES = [{"role": "user", "content": "Say hi"}]


def _band(s: RouterStack, objective: str) -> dict:
    return next(b for b in s.state()["bands"] if b["objective"] == objective)


def test_flex_on_spare_room_answers_as_flex_and_other_tiers_are_unchanged(tmp_path: Path) -> None:
    with RouterStack(tmp_path, engines=1) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        # an untrusted caller's objective header is dropped: it cannot lift its flex request
        answer = client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4,
                                                service_tier="flex",
                                                extra_headers={"x-llm-d-inference-objective": "interactive"})
        assert answer.service_tier == "flex" and answer.choices[0].message.content
        chunks = list(client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4,
                                                     service_tier="flex", stream=True))
        assert chunks and {c.service_tier for c in chunks} == {"flex"}
        completion = client.completions.create(model="sim-model", prompt="Once upon", max_tokens=3,
                                               extra_body={"service_tier": "flex"})
        assert completion.usage.completion_tokens == 3
        assert completion.model_extra.get("service_tier") == "flex"
        response = client.responses.create(model="sim-model", input="hello", max_output_tokens=16,
                                           service_tier="flex")
        assert response.service_tier == "flex" and response.output_text
        events = list(client.responses.create(model="sim-model", input="hello", max_output_tokens=16,
                                              service_tier="flex", stream=True))
        carrying = [e for e in events if e.type in ("response.created", "response.completed", "response.incomplete")]
        assert len(carrying) == 2 and {e.response.service_tier for e in carrying} == {"flex"}
        assert _band(s, "flex")["dispatched_total"] == 5
        assert 'backfill_router_dispatched_total{band="flex"} 5.0' in httpx.get(f"{s.url}/metrics", timeout=5).text

        # auto, default and none: the interactive band, the engine's own answer (the twin says null)
        for tier in ("auto", "default", None):
            extra = {"service_tier": tier} if tier else {}
            plain = client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4, **extra)
            assert plain.service_tier is None
        assert _band(s, "interactive")["dispatched_total"] == 3 and _band(s, "flex")["dispatched_total"] == 5


def test_flex_with_no_room_is_held_then_gets_openais_429_while_interactive_goes(tmp_path: Path) -> None:
    bands = tmp_path / "bands.yaml"
    bands.write_text(BANDS)
    slow = {"time_scale": 1.0, "max_num_seqs": 1}
    with RouterStack(tmp_path, engines=1, engine_options=[slow], router_options={"flow_control": str(bands)}) as s:
        engine = s.engine_urls[0]
        _hog(engine, 6, ENDLESS_TOKENS)  # none ends while the test looks
        state = _wait_waiting(s, engine, 5)
        assert state["gate_saturation"] >= 1.0  # no engine has room

        outcome: dict[str, object] = {}

        def flex_call() -> None:
            client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
            try:
                client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4, service_tier="flex")
            except openai.APIStatusError as exc:
                outcome["error"] = exc

        caller = threading.Thread(target=flex_call, daemon=True)
        caller.start()
        wait_for(lambda: _band(s, "flex")["queued_requests"] == 1, "the flex request held in its band")

        # interactive work is dispatched while flex waits (it bypasses the gate); its answer is
        # not awaited: the engine's one slot is the hogs'
        before = _band(s, "interactive")["dispatched_total"]
        threading.Thread(target=lambda: httpx.post(f"{s.url}/v1/chat/completions", timeout=FLEX_WAIT_S * 3, json={
            "model": "sim-model", "messages": MESSAGES, "max_tokens": 4}), daemon=True).start()
        wait_for(lambda: _band(s, "interactive")["dispatched_total"] == before + 1, "the interactive request dispatched")
        assert _band(s, "flex")["queued_requests"] == 1  # still held: flex never went ahead of it

        wait_for(lambda: "error" in outcome, "the flex request answered", timeout=FLEX_WAIT_S + 30)
        error = outcome["error"]
        assert isinstance(error, openai.RateLimitError)
        assert error.status_code == 429 and error.code == "resource_unavailable"
        assert error.response.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
        assert "Resource unavailable" in error.message
        flex = _band(s, "flex")
        assert flex["queued_requests"] == 0 and flex["dispatched_total"] == 0
        assert flex["shed_total"]["rejected_ttl_expired"] == 1


def test_a_flex_request_evicted_mid_flight_gets_openais_429(tmp_path: Path, monkeypatch) -> None:
    # no slot reserve: flex may hold all 4 slots of the engine; an interactive request then evicts one
    monkeypatch.setenv("BACKFILL_ROUTER_MIN_SLOT_RESERVE", "0")
    monkeypatch.setenv("BACKFILL_ROUTER_SLOT_RESERVE_FRACTION", "0")
    with RouterStack(tmp_path, engines=1, engine_options=[{"time_scale": 1.0, "max_num_seqs": 4}]) as s:
        url = s.engine_urls[0]
        _learn_the_slot_count(s, url)
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        aborted_before = _aborted(url)
        flex = {"model": "sim-model", "messages": MESSAGES, "max_tokens": ENDLESS_TOKENS, "service_tier": "flex"}

        async def scenario() -> tuple[list[httpx.Response], int]:
            async with httpx.AsyncClient(timeout=120) as http:
                senders: list[asyncio.Task] = []
                for n in range(1, 5):  # one at a time, so "newest" is the fourth
                    senders.append(asyncio.create_task(http.post(f"{s.url}/v1/chat/completions", json=flex)))
                    await asyncio.to_thread(wait_for, lambda n=n: _endpoint(s, url)["num_requests_running"] == n,
                                            f"flex request {n} running")
                await asyncio.to_thread(chat, client, "interactive", "now")  # evicts the newest flex request
                await asyncio.wait(senders, timeout=30, return_when=asyncio.FIRST_COMPLETED)
                ended = [t.result() for t in senders if t.done()]
                still_running = sum(not t.done() for t in senders)
                await _stop(senders)
                return ended, still_running

        ended, still_running = asyncio.run(scenario())
        assert len(ended) == 1 and still_running == 3  # only the evicted one has ended
        [evicted] = ended
        assert evicted.status_code == 429, evicted.text
        error = evicted.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "resource_unavailable")
        assert "Resource unavailable" in error["message"]
        assert evicted.headers["x-llm-d-request-dropped-reason"] == "evicted" and evicted.headers["retry-after"] == "1"
        assert _band(s, "flex")["shed_total"]["evicted"] == 1
        assert _aborted(url) >= aborted_before + 1  # the engine aborted the evicted request

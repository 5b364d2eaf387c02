"""OpenAI's flex processing through ``backfill router`` with the official ``openai`` client:
``service_tier="flex"`` is served from spare capacity and the answer says ``"flex"`` (JSON and
stream, Chat Completions, Completions and Responses); with no room anywhere the request is held
in the router's ``flex`` band for the band's bounded wait, interactive work goes meanwhile, and the
client then gets OpenAI's 429 ``resource_unavailable``."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai

from tests.integration.test_router_proxy import _hog
from tests.integration.test_router_proxy_make_room import ENDLESS_TOKENS, _wait_waiting
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

"""The Responses API state at the router, end to end: two ``backfill router`` replicas sharing one
real Redis (``--state-redis-url``) in front of three simulated engines, driven with the real
``openai`` client (``responses.create(previous_response_id=…)``, ``retrieve``, ``delete``,
``input_items.list``, streaming).

A chained turn reaches the engine holding the conversation (the engine's ``cached_tokens`` cover
the whole previous prompt), a response stored through one replica chains and is retrieved through
the other (state is shared; prefix locality across replicas is the KV-event index's job), tenants see only their own responses, and records carry the configured TTL.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import redis

from common.contracts.responses import record_key
from router.cli import router_argv
from router.trust import TOKEN_HEADER
from tests.integration.engine_twin.conftest import free_port
from tests.router_stack import SPREAD_CONFIG, RouterStack

TTL_S = 600
#: Instructions of 2,000 bytes (500 tokens for the router's estimate and the engines' tokenizer).
RULES = "".join(f"Rule {i}: answer tersely and cite section {i}. " for i in range(60))[:2000]


class Fleet:
    def __init__(self, stack: RouterStack, second_url: str, redis_url: str) -> None:
        self.stack = stack
        self.urls = (stack.url, second_url)
        self.redis_url = redis_url

    def client(self, tenant: str = "tenant-a", replica: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[replica]}/v1", api_key="unused", max_retries=0, timeout=30,
                             default_headers={TOKEN_HEADER: self.stack.token or "",
                                              "x-llm-d-inference-fairness-id": tenant})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, stores) -> Fleet:
    log_dir: Path = tmp_path_factory.mktemp("responses-stack")
    config = log_dir / "spread.yaml"
    config.write_text(SPREAD_CONFIG)
    extra = ["--state-redis-url", stores.redis_url, "--responses-ttl-s", str(TTL_S)]
    with RouterStack(log_dir, engines=3, router_options={"config": str(config), "extra": extra}) as stack:
        port = free_port()
        second = stack._spawn(router_argv(port, stack.engine_urls, config=str(config), extra=extra), "router2",
                              {"BACKFILL_ROUTER_TRUSTED_TOKEN": stack.token or ""})
        try:
            from engine_twin.launch import wait_ready

            wait_ready(f"http://127.0.0.1:{port}", timeout=30, process=second)
            yield Fleet(stack, f"http://127.0.0.1:{port}", stores.redis_url)
        finally:
            second.terminate()
            second.wait(10)


def test_a_chain_across_replicas_reaches_the_engine_holding_it(fleet: Fleet):
    a1, a2 = fleet.client(replica=0), fleet.client(replica=1)
    first = a1.responses.create(model="sim-model", instructions=RULES, input="Where is the handbook?",
                                max_output_tokens=8)
    # cut at max_output_tokens: incomplete (OpenAI's rule), and stored and chained like a completed one
    assert first.id.startswith("resp_") and first.status == "incomplete" and first.store is True
    assert first.previous_response_id is None and first.output_text
    second = a1.responses.create(model="sim-model", instructions=RULES, input="And the index?",
                                 previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id and second.id != first.id
    assert second.usage is not None and first.usage is not None
    # the whole first turn (prompt and the answer passed back) was the prefix of the second
    assert second.usage.input_tokens > first.usage.input_tokens + 8
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // 16 - 1) * 16
    # the other replica reads the same state (its approximate prefix index has not seen this
    # conversation: locality across replicas needs the engines' KV events at every replica)
    third = a2.responses.create(model="sim-model", instructions=RULES, input="Thanks.",
                                previous_response_id=second.id, max_output_tokens=8)
    assert third.previous_response_id == second.id
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens + 8

    got = a2.responses.retrieve(third.id)
    assert got.id == third.id and got.output_text == third.output_text and got.previous_response_id == second.id
    items = a1.responses.input_items.list(third.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "user"), ("message", "assistant"),
                                                      ("message", "user"), ("message", "assistant"),
                                                      ("message", "user")]
    assert items.data[0].content[0].text == "Where is the handbook?"

    ttl = redis.Redis.from_url(fleet.redis_url).ttl(record_key("tenant-a", third.id))
    assert 0 < ttl <= TTL_S

    deleted = a2.responses.with_raw_response.delete(third.id)  # the SDK's plain delete() returns None
    assert deleted.http_response.json() == {"id": third.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as gone:
        a1.responses.retrieve(third.id)
    assert gone.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as unknown:
        a1.responses.create(model="sim-model", input="more", previous_response_id=third.id)
    assert unknown.value.code == "previous_response_not_found" and unknown.value.param == "previous_response_id"


def test_streamed_turns_are_stored_before_they_complete(fleet: Fleet):
    client = fleet.client(replica=1)
    events = list(client.responses.create(model="sim-model", input="stream me", max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds
    created, in_progress, completed = (e.response for e in (events[0], events[1], events[-1]))  # type: ignore[union-attr]
    assert created.id == in_progress.id == completed.id and completed.store is True
    # chained at once through the other replica
    nxt = fleet.client(replica=0).responses.create(model="sim-model", input="next", previous_response_id=completed.id,
                                                   max_output_tokens=4)
    assert nxt.previous_response_id == completed.id
    # the SDK's stream helper reads the router's stream (the lifecycle events keep one id) and the
    # completed answer is stored and chainable
    with client.responses.stream(model="sim-model", input="stream to the end") as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.id.startswith("resp_") and final.store is True and final.output_text
    assert fleet.client(replica=0).responses.retrieve(final.id).output_text == final.output_text


def test_tenants_see_only_their_own_responses(fleet: Fleet):
    mine = fleet.client("tenant-a").responses.create(model="sim-model", input="secret", max_output_tokens=2)
    theirs = fleet.client("tenant-b")
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(mine.id)
    with pytest.raises(openai.BadRequestError) as chained:
        theirs.responses.create(model="sim-model", input="x", previous_response_id=mine.id)
    assert chained.value.code == "previous_response_not_found"
    # an untrusted caller is tenant "anonymous", whatever fairness id it claims
    untrusted = httpx.get(f"{fleet.urls[0]}/v1/responses/{mine.id}",
                          headers={"x-llm-d-inference-fairness-id": "tenant-a"}, timeout=10)
    assert untrusted.status_code == 404
    assert fleet.client("tenant-a").responses.retrieve(mine.id).id == mine.id


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "previous_response_id": ["resp_1"]}, "previous_response_id"),
    ({}, "input"),
    ({"input": 3}, "input"),
])
def test_bad_input_is_a_400_in_openais_envelope(fleet: Fleet, body, param):
    r = httpx.post(f"{fleet.urls[0]}/v1/responses", json={"model": "sim-model", **body}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"

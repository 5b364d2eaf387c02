"""The router's Responses API state: input rebuilding, object shapes, tenant isolation, the TTL and
the not-found errors, with the in-memory store (the Redis store runs the same paths in
tests/integration/router/test_responses_state.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.chatml import render_chat
from common.contracts.responses import StoredResponse, conversation_input, record_key, tenant_hash
from router.parsing import RESPONSES_PATH, RequestError, parse_request
from router.responses import MemoryResponseStore, ResponsesAPI, ResponsesTurn, StoreUnavailable
from router.responses.api import listed_items
from router.trust import TOKEN_HEADER, HeaderTrust


def parsed(body: dict[str, Any], tenant: str | None = "tenant-a"):
    request = parse_request(RESPONSES_PATH, orjson.dumps({"model": "m", **body}), {})
    request.fairness_id = tenant
    return request


def engine_response(text: str = "hello there", status: str = "completed", cached: int = 7) -> dict[str, Any]:
    """What an engine (vLLM, the twin) answers: its own id, ``store: false`` as it was asked."""
    return {"id": "resp_engine", "object": "response", "created_at": 1, "model": "m", "status": status,
            "output": [{"id": "msg_engine", "type": "message", "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": 30, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": 3,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 33},
            "store": False, "previous_response_id": None}


async def turn_of(store, body: dict[str, Any], tenant: str | None = "tenant-a", answer: dict | None = None):
    """Run one create through the hook; (turn, prepared request, the client's JSON)."""
    turn = ResponsesTurn(store)
    prepared = await turn.prepare(parsed(body, tenant), {})
    out = orjson.loads(await turn.answer(200, orjson.dumps(answer or engine_response())))
    return turn, prepared, out


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- input rebuilding --------------------------------------------------------------------------
def test_rebuild_is_previous_input_then_its_output_then_the_new_input():
    previous = StoredResponse(response=engine_response("A1"), input=[{"type": "message", "role": "user",
                                                                       "content": "U1"}])
    items = conversation_input(previous.input, previous.output, "U2")
    assert [(i.get("role"), i["type"]) for i in items] == [("user", "message"), ("assistant", "message"),
                                                            ("user", "message")]
    assert items[1] == engine_response("A1")["output"][0]
    assert items[2] == {"type": "message", "role": "user", "content": "U2"}
    listed = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "U3"}]}]
    assert conversation_input(previous.input, previous.output, listed)[2:] == listed


def test_a_chained_turn_sends_the_whole_conversation_stateless_and_its_prompt_extends_the_first():
    async def run():
        store = MemoryResponseStore(ttl_s=60)
        first, first_req, first_out = await turn_of(store, {"input": "U1", "instructions": "be terse"})
        second, second_req, _ = await turn_of(store, {"input": "U2", "instructions": "be terse",
                                                      "previous_response_id": first_out["id"]})
        return first_req, second_req
    first_req, second_req = asyncio.run(run())
    body = orjson.loads(second_req.raw)
    assert "previous_response_id" not in body and body["store"] is False
    assert [i.get("role") for i in body["input"]] == ["user", "assistant", "user"]
    # what the scheduler hashes: the whole conversation, with the first turn's prompt as its prefix
    assert second_req.prompt_text.startswith(first_req.prompt_text)
    assert "hello there" in second_req.prompt_text and second_req.prompt_text == render_chat(second_req.messages)
    assert second_req.fairness_id == "tenant-a"


def test_instructions_are_not_carried_over():
    async def run():
        store = MemoryResponseStore(ttl_s=60)
        _, _, out = await turn_of(store, {"input": "U1", "instructions": "old rules"})
        _, req, _ = await turn_of(store, {"input": "U2", "previous_response_id": out["id"]})
        return req
    req = asyncio.run(run())
    assert "old rules" not in req.prompt_text and "instructions" not in orjson.loads(req.raw)


# ---- object shapes -----------------------------------------------------------------------------
def test_the_answer_gets_the_routers_id_and_is_stored_as_the_client_got_it():
    async def run():
        store = MemoryResponseStore(ttl_s=60)
        turn, _, out = await turn_of(store, {"input": "U1"})
        return turn, out, await store.get("tenant-a", out["id"])
    turn, out, record = asyncio.run(run())
    assert out["id"] == turn.response_id and out["id"].startswith("resp_") and len(out["id"]) == 53
    assert out["object"] == "response" and out["store"] is True and out["previous_response_id"] is None
    assert out["output"][0]["content"][0] == {"type": "output_text", "text": "hello there", "annotations": []}
    assert out["usage"]["input_tokens_details"]["cached_tokens"] == 7 and turn.cached_tokens == 7
    assert record is not None and record.response == out
    assert record.input == [{"type": "message", "role": "user", "content": "U1"}]


def test_store_false_and_failed_responses_are_not_kept():
    async def run():
        store = MemoryResponseStore(ttl_s=60)
        _, _, out = await turn_of(store, {"input": "U1", "store": False})
        _, _, failed = await turn_of(store, {"input": "U1"}, answer=engine_response(status="failed"))
        return out, failed, await store.get("tenant-a", out["id"]), await store.get("tenant-a", failed["id"])
    out, failed, kept, kept_failed = asyncio.run(run())
    assert out["store"] is False and kept is None
    assert failed["store"] is False and kept_failed is None


def test_engine_errors_pass_unchanged():
    async def run():
        turn = ResponsesTurn(MemoryResponseStore(ttl_s=60))
        await turn.prepare(parsed({"input": "x"}), {})
        body = b'{"error": {"message": "too long", "type": "BadRequestError", "param": null, "code": 400}}'
        return body, await turn.answer(400, body)
    sent, got = asyncio.run(run())
    assert got == sent


class FailingStore(MemoryResponseStore):
    async def put(self, tenant: str, response_id: str, record: StoredResponse) -> None:
        raise StoreUnavailable("ConnectionError: down")

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raise StoreUnavailable("ConnectionError: down")


def test_a_store_that_fails_keeps_the_answer_with_store_false_and_a_lookup_is_a_503():
    async def run():
        store = FailingStore(ttl_s=60)
        _, _, out = await turn_of(store, {"input": "U1"})
        with pytest.raises(RequestError) as excinfo:
            await ResponsesTurn(store).prepare(parsed({"input": "U2", "previous_response_id": "resp_x"}), {})
        return out, excinfo.value
    out, error = asyncio.run(run())
    assert out["store"] is False and out["output"][0]["content"][0]["text"] == "hello there"
    assert error.status == 503 and error.code == "state_store_unavailable" and error.type == "server_error"


# ---- streaming ---------------------------------------------------------------------------------
def sse(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def test_the_stream_is_stamped_and_stored_before_the_final_event_reaches_the_client():
    created = {**engine_response(), "status": "in_progress", "output": [], "usage": None}
    stream = (sse("response.created", sequence_number=0, response=created)
              + sse("response.output_text.delta", sequence_number=1, item_id="msg_engine", delta="hello")
              + sse("response.completed", sequence_number=2, response=engine_response()))
    store = MemoryResponseStore(ttl_s=60)
    seen_stored_before_final: list[bool] = []

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(stream), 7):  # event boundaries fall inside chunks
            yield stream[i:i + 7]

    async def run():
        turn = ResponsesTurn(store)
        await turn.prepare(parsed({"input": "U1", "stream": True}), {})
        out = []
        async for chunk in turn.stream(chunks()):
            if b"response.completed" in chunk:
                seen_stored_before_final.append(await store.get("tenant-a", turn.response_id) is not None)
            out.append(chunk)
        return turn, b"".join(out)
    turn, out = asyncio.run(run())
    events = [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.output_text.delta", "response.completed"]
    assert events[0]["response"]["id"] == events[2]["response"]["id"] == turn.response_id
    assert events[0]["response"]["store"] is True and events[2]["response"]["store"] is True
    assert events[1] == {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_engine",
                         "delta": "hello"}
    assert seen_stored_before_final == [True] and turn.cached_tokens == 7
    assert out.count(b"\n\n") == 3 and out.startswith(b"event: response.created\ndata: ")


# ---- not found, tenants, TTL -------------------------------------------------------------------
def test_unknown_previous_response_is_openais_400_previous_response_not_found():
    async def run():
        with pytest.raises(RequestError) as excinfo:
            await ResponsesTurn(MemoryResponseStore(ttl_s=60)).prepare(
                parsed({"input": "x", "previous_response_id": "resp_nope"}), {})
        return excinfo.value
    error = asyncio.run(run())
    assert (error.status, error.type, error.param, error.code) == (400, "invalid_request_error",
                                                                   "previous_response_id",
                                                                   "previous_response_not_found")
    assert error.message == "Previous response with id 'resp_nope' not found."


def test_without_a_store_nothing_is_kept_and_every_previous_id_is_unknown():
    async def run():
        _, _, out = await turn_of(None, {"input": "U1"})
        with pytest.raises(RequestError) as excinfo:
            await ResponsesTurn(None).prepare(parsed({"input": "x", "previous_response_id": out["id"]}), {})
        return out, excinfo.value
    out, error = asyncio.run(run())
    assert out["store"] is False
    assert error.status == 400 and error.code == "previous_response_not_found" and "--state-redis-url" in error.message


def test_another_tenants_response_is_unknown():
    async def run():
        store = MemoryResponseStore(ttl_s=60)
        _, _, out = await turn_of(store, {"input": "U1"}, tenant="tenant-a")
        with pytest.raises(RequestError) as excinfo:
            await ResponsesTurn(store).prepare(parsed({"input": "x", "previous_response_id": out["id"]},
                                                      tenant="tenant-b"), {})
        return out, excinfo.value, await store.get("tenant-b", out["id"]), await store.delete("tenant-b", out["id"])
    out, error, seen_by_b, deleted_by_b = asyncio.run(run())
    assert error.code == "previous_response_not_found" and seen_by_b is None and deleted_by_b is False


def test_keys_scope_tenants_by_a_fixed_length_hash():
    assert record_key("a:b", "resp_1") != record_key("a", "b:resp_1")
    assert len(tenant_hash("x" * 300)) == 32 and record_key("t", "resp_1").endswith(":resp_1")


def test_a_record_expires_after_the_ttl():
    clock = Clock()
    store = MemoryResponseStore(ttl_s=60, clock=clock)

    async def run():
        _, _, out = await turn_of(store, {"input": "U1"})
        clock.now += 59.9
        alive = await store.get("tenant-a", out["id"])
        clock.now += 0.2
        return alive, await store.get("tenant-a", out["id"])
    alive, expired = asyncio.run(run())
    assert alive is not None and expired is None


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "previous_response_id": 12}, "previous_response_id"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
])
def test_bad_fields_are_400_naming_the_param(body, param):
    async def run():
        with pytest.raises(RequestError) as excinfo:
            await ResponsesTurn(MemoryResponseStore(ttl_s=60)).prepare(parsed(body), {})
        return excinfo.value
    error = asyncio.run(run())
    assert error.status == 400 and error.param == param and error.type == "invalid_request_error"


# ---- the GET / DELETE / input_items routes ------------------------------------------------------
class FakeProxy:
    trust = HeaderTrust("tok")


async def api_client(store) -> TestClient:
    api = ResponsesAPI(lambda: FakeProxy())  # type: ignore[arg-type, return-value]
    api.store = store
    app = web.Application()
    api.add_routes(app.router)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


def as_tenant(tenant: str) -> dict[str, str]:
    return {TOKEN_HEADER: "tok", "x-llm-d-inference-fairness-id": tenant}


def test_retrieve_delete_and_input_items_as_openai_answers_them():
    async def run():
        store = MemoryResponseStore(ttl_s=60)
        _, _, first = await turn_of(store, {"input": "U1"})
        _, _, second = await turn_of(store, {"input": "U2", "previous_response_id": first["id"]})
        client = await api_client(store)
        try:
            got = await (await client.get(f"/v1/responses/{second['id']}", headers=as_tenant("tenant-a"))).json()
            other = await client.get(f"/v1/responses/{second['id']}", headers=as_tenant("tenant-b"))
            untrusted = await client.get(f"/v1/responses/{second['id']}",
                                         headers={"x-llm-d-inference-fairness-id": "tenant-a"})
            items = await (await client.get(f"/v1/responses/{second['id']}/input_items?order=asc&limit=2",
                                            headers=as_tenant("tenant-a"))).json()
            rest = await (await client.get(f"/v1/responses/{second['id']}/input_items?order=asc&after="
                                           f"{items['last_id']}", headers=as_tenant("tenant-a"))).json()
            bad_limit = await client.get(f"/v1/responses/{second['id']}/input_items?limit=0",
                                         headers=as_tenant("tenant-a"))
            deleted_by_b = await client.delete(f"/v1/responses/{second['id']}", headers=as_tenant("tenant-b"))
            deleted = await (await client.delete(f"/v1/responses/{second['id']}",
                                                 headers=as_tenant("tenant-a"))).json()
            gone = await client.get(f"/v1/responses/{second['id']}", headers=as_tenant("tenant-a"))
            return (second, got, other.status, await other.json(), untrusted.status, items, rest,
                    bad_limit.status, deleted_by_b.status, deleted, gone.status, await gone.json())
        finally:
            await client.close()
    (second, got, other_status, other_body, untrusted_status, items, rest, bad_limit, deleted_by_b, deleted,
     gone_status, gone_body) = asyncio.run(run())
    assert got == second and got["previous_response_id"] is not None
    assert other_status == 404 == untrusted_status
    assert other_body == {"error": {"message": f"Response with id '{second['id']}' not found.",
                                    "type": "invalid_request_error", "param": None, "code": None}}
    assert items["object"] == "list" and items["has_more"] is True
    assert [(i["role"], i["content"][0]["type"]) for i in items["data"]] == [("user", "input_text"),
                                                                              ("assistant", "output_text")]
    assert items["data"][1]["id"] == "msg_engine" and items["first_id"] == items["data"][0]["id"]
    assert [i["content"][0]["text"] for i in rest["data"]] == ["U2"] and rest["has_more"] is False
    assert bad_limit == 400 and deleted_by_b == 404
    assert deleted == {"id": second["id"], "object": "response.deleted", "deleted": True}
    assert gone_status == 404 and gone_body["error"]["type"] == "invalid_request_error"


def test_listed_items_get_ids_and_parts():
    items = listed_items("resp_ab", [{"role": "user", "content": "hi"}, {"type": "function_call_output",
                                                                         "call_id": "c", "output": "{}"}])
    assert items[0] == {"role": "user", "type": "message", "id": "msg_ab_0",
                        "content": [{"type": "input_text", "text": "hi"}]}
    assert items[1]["id"] == "msg_ab_1" and items[1]["output"] == "{}"


def test_stored_records_are_the_contracts_json():
    record = StoredResponse(response=engine_response(), input=[{"type": "message", "role": "user", "content": "x"}])
    data = orjson.loads(record.to_json())
    assert data["v"] == 1 and set(data) == {"v", "response", "input"}
    assert StoredResponse.from_json(record.to_json()).output == engine_response()["output"]
    for bad in (b"[]", b'{"v": 1}', b'{"v": "1", "response": {}}', b"{"):
        with pytest.raises(ValueError):
            StoredResponse.from_json(bad)


def test_unreadable_or_newer_records_are_absent():
    async def run():
        store = MemoryResponseStore(ttl_s=60)
        store._records[record_key("t", "resp_bad")] = (float("inf"), b"not json")
        store._records[record_key("t", "resp_new")] = (float("inf"), b'{"v": 2, "response": {}, "input": []}')
        return await store.get("t", "resp_bad"), await store.get("t", "resp_new")
    assert asyncio.run(run()) == (None, None)


def test_the_start_check_names_an_unreachable_state_redis_and_passes_a_live_one(stores):
    from backfill.up import free_port

    async def check(url: str | None) -> str | None:
        api = ResponsesAPI(lambda: None)  # type: ignore[arg-type, return-value]
        api.open(url, 60)
        try:
            return await api.check()
        finally:
            await api.aclose()

    assert asyncio.run(check(None)) is None  # no store configured: nothing to check
    assert asyncio.run(check(stores.redis_url)) is None
    problem = asyncio.run(check(f"redis://127.0.0.1:{free_port()}/0"))  # nothing listens there
    assert problem is not None and "Connection" in problem

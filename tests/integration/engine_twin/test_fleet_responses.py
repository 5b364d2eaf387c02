"""``/v1/responses`` of the simulator as OpenAI's Responses API and vLLM give it: the streamed event
sequence (read by the real ``openai`` SDK's ``responses.stream()`` helper, and raw), ``incomplete``
when ``max_output_tokens`` cuts the output, and 400s in the error envelope for bad ``input``."""

import httpx
import openai
import orjson
import pytest

MODEL = "gpt-3.5-turbo"
STREAM_KINDS = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
END_KINDS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def client(sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0)


def raw_events(sim, body: dict) -> list[tuple[str, dict]]:
    """(``event:`` name, data) of each SSE event of a streamed ``POST /v1/responses``."""
    with httpx.stream("POST", f"{sim.url}/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name[len("event: "):], orjson.loads(data[len("data: "):])))
    return events


def test_the_sdk_stream_helper_accumulates_a_completed_response(sim):
    pieces = sim.engine.pieces(sim.settings.default_max_tokens)
    with client(sim).responses.stream(model=MODEL, input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == STREAM_KINDS + ["response.output_text.delta"] * len(pieces) + END_KINDS + ["response.completed"]
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == pieces  # type: ignore[union-attr]
    assert [e.snapshot for e in events if e.type == "response.output_text.delta"][-1] == "".join(pieces)  # type: ignore[union-attr]
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == "".join(pieces) and final.usage is not None
    assert final.usage.output_tokens == len(pieces)


def test_streamed_events_carry_openais_fields_and_sequence_numbers(sim):
    events = raw_events(sim, {"input": "hello"})
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    by_kind = {data["type"]: data for _, data in events}
    created, in_progress = by_kind["response.created"]["response"], by_kind["response.in_progress"]["response"]
    final = by_kind["response.completed"]["response"]
    assert created == in_progress and created["status"] == "in_progress" and created["output"] == []
    assert created["id"] == final["id"] and created["created_at"] == final["created_at"]
    added = by_kind["response.output_item.added"]
    item_id = added["item"]["id"]
    assert added["output_index"] == 0 and item_id.startswith("msg_")
    assert added["item"] == {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}
    part = by_kind["response.content_part.added"]
    assert (part["item_id"], part["output_index"], part["content_index"]) == (item_id, 0, 0)
    assert part["part"]["type"] == "output_text" and part["part"]["text"] == ""
    for _, data in events:
        if data["type"].startswith(("response.output_text.", "response.content_part.")):
            assert (data["item_id"], data["output_index"], data["content_index"]) == (item_id, 0, 0)
    text = "".join(data["delta"] for _, data in events if data["type"] == "response.output_text.delta")
    assert by_kind["response.output_text.done"]["text"] == text
    assert by_kind["response.content_part.done"]["part"]["text"] == text
    done = by_kind["response.output_item.done"]
    assert done["output_index"] == 0 and done["item"]["id"] == item_id and done["item"]["status"] == "completed"
    assert done["item"]["content"][0]["text"] == text
    assert final["status"] == "completed" and final["output"][0]["id"] == item_id
    assert final["output"][0]["content"][0]["text"] == text


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(sim):
    events = raw_events(sim, {"input": "short", "max_output_tokens": 2})
    kinds = [data["type"] for _, data in events]
    assert kinds == STREAM_KINDS + ["response.output_text.delta"] * 2 + END_KINDS + ["response.incomplete"]
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 2 and final["output"][0]["status"] == "incomplete"
    assert events[-2][1]["item"]["status"] == "incomplete"
    # the SDK's helper reads it to the end (it keeps a final response only for response.completed)
    with client(sim).responses.stream(model=MODEL, input="short", max_output_tokens=2) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete"
    assert last.response.output_text == "".join(sim.engine.pieces(2))  # type: ignore[union-attr]


def test_max_output_tokens_reached_is_incomplete_else_completed(sim):
    cut = client(sim).responses.create(model=MODEL, input="short", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == "".join(sim.engine.pieces(2))
    full = client(sim).responses.create(model=MODEL, input="short")
    assert full.status == "completed" and full.incomplete_details is None


@pytest.mark.parametrize(("item", "where"), [
    ({"foo": "bar"}, "input[0].role"),
    ({"role": "user"}, "input[0].content"),
    ({"role": "robot", "content": "x"}, "input[0].role"),
    ({"type": "bogus", "content": "x"}, "input[0].type"),
    ({"role": "user", "content": 5}, "input[0].content"),
    ({"role": "user", "content": [{"type": "input_text", "text": 3}]}, "input[0].content[0].text"),
    ({"role": "user", "content": ["plain"]}, "input[0].content[0]"),
    ("plain", "input[0]"),
])
def test_an_invalid_input_item_is_a_400_naming_input(sim, item, where):
    r = httpx.post(f"{sim.url}/v1/responses", json={"model": MODEL, "input": [item]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input" and error["type"] == "BadRequestError" and error["code"] == 400
    assert f"'{where}" in error["message"]


def test_other_item_types_and_passed_back_output_are_accepted(sim):
    first = client(sim).responses.create(model=MODEL, input="hi", max_output_tokens=3)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             first.output[0].model_dump(),
             {"type": "function_call_output", "call_id": "call_1", "output": "42"},
             {"type": "message", "role": "developer", "content": "go on"}]
    r = httpx.post(f"{sim.url}/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] > first.usage.input_tokens  # type: ignore[union-attr]


def test_a_too_long_input_is_a_400_on_input(sim):
    r = httpx.post(f"{sim.url}/v1/responses", json={"model": MODEL, "input": "x" * 200_000})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input" and "maximum context length is 16384 tokens" in error["message"]
    chat = httpx.post(f"{sim.url}/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 200_000}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"

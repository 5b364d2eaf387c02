"""Background responses through ``backfill up`` (gateway, worker + beat, processor, router, a
simulated engine) with the real ``openai`` client, as a user runs them: create with
``background=True`` answers ``queued``, ``retrieve`` until it completes with output text, the
stored events replay as a stream, a stream from create follows it to its end, a chained turn sees
the first, and a cancel sticks; a flex call at the stack's router answers as flex. (The Node SDK's
run of the same: ``test_node_sdk.py``.)"""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.conftest import backfill_up

MODEL = "gpt-4o-mini"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("bg") / "data"
    with backfill_up(data, "--engines", "1", "--served-model-name", MODEL) as up:
        yield up, json.loads((data / "stack.json").read_text())["router_url"]


@pytest.fixture(scope="module")
def client(stack):
    return stack[0].client()


def wait_ended(client, response_id: str, timeout: float = 60.0):
    """Poll until the response leaves ``queued`` / ``in_progress``; returns it and the statuses seen."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        response = client.responses.retrieve(response_id)
        if not seen or seen[-1] != response.status:
            seen.append(response.status)
        if response.status not in ("queued", "in_progress"):
            return response, seen
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.1)


def test_create_retrieve_stream_and_chain(client):
    created = client.responses.create(model=MODEL, input="Tell me about otters.", background=True,
                                      max_output_tokens=16)
    assert created.status == "queued" and created.background is True
    done, seen = wait_ended(client, created.id)
    assert done.status in ("completed", "incomplete"), (seen, done.error)
    assert set(seen) <= {"queued", "in_progress", done.status}
    assert done.output_text and done.usage is not None and done.usage.output_tokens > 0

    events = list(client.responses.retrieve(created.id, stream=True))
    assert events[0].type == "response.created" and events[-1].type == f"response.{done.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text

    second = client.responses.create(model=MODEL, input="And more?", background=True, max_output_tokens=8,
                                     previous_response_id=created.id)
    chained, _ = wait_ended(client, second.id)
    assert chained.status in ("completed", "incomplete") and chained.previous_response_id == created.id
    assert chained.usage.input_tokens > done.usage.input_tokens  # the first turn is in its prompt


def test_cancel_sticks(client):
    created = client.responses.create(model=MODEL, input="Write a very long novel about otters in space.",
                                      background=True, max_output_tokens=4000)
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    other = client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=4)
    wait_ended(client, other.id)  # later work ran to its end: the cancelled one stays cancelled
    assert client.responses.retrieve(created.id).status == "cancelled"


def test_stream_from_create_follows_it_to_its_end(client):
    events = list(client.responses.create(model=MODEL, input="Stream it.", background=True, stream=True,
                                          max_output_tokens=8))
    assert [e.type for e in events[:2]] == ["response.created", "response.queued"]
    assert events[0].response.status == "queued" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == client.responses.retrieve(events[0].response.id).output_text


def test_a_flex_call_at_the_router_answers_as_flex(stack):
    up, router_url = stack
    router = openai.OpenAI(base_url=router_url + "/v1", api_key=up.api_key, max_retries=0, timeout=900)
    answer = router.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            service_tier="flex")
    assert answer.service_tier == "flex" and answer.choices[0].message.content

"""Background responses through ``backfill up`` (gateway, worker + beat, processor, router, a
simulated engine) with the real ``openai`` client, as a user runs them: create with
``background=True`` answers ``queued``, ``retrieve`` until it completes with output text, the
stored events replay as a stream, a chained turn sees the first, and a cancel sticks."""

from __future__ import annotations

import time

import pytest

from tests.conftest import backfill_up

MODEL = "gpt-4o-mini"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with backfill_up(tmp_path_factory.mktemp("bg") / "data", "--engines", "1", "--served-model-name", MODEL) as up:
        yield up.client()


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

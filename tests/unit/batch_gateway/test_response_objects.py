"""The Response object of a stored background response and the events it replays."""

from __future__ import annotations

from batch_gateway.response_objects import response_events, response_object
from batch_gateway.store.models import BackgroundResponse

OUTPUT = [{"type": "reasoning", "id": "rs_1", "summary": []},
          {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": "Otters hold hands.", "annotations": []}]}]


def _row(status: str, **values) -> BackgroundResponse:
    return BackgroundResponse(id="resp_1", tenant_id="t", status=status, model="m", previous_response_id=None,
                              request={"model": "m", "input": "x", "background": True, "temperature": 0.5,
                                       "metadata": {"k": "v"}},
                              input=[], created_at=100, **values)


def test_the_object_echoes_the_request_with_openai_defaults():
    obj = response_object(_row("queued"))
    assert obj["status"] == "queued" and obj["background"] is True and obj["store"] is True
    assert obj["temperature"] == 0.5 and obj["top_p"] == 1.0 and obj["metadata"] == {"k": "v"}
    assert obj["output"] == [] and obj["usage"] is None and "completed_at" not in obj


def test_an_open_response_has_only_its_first_events():
    assert [e["type"] for e in response_events(_row("queued"))] == ["response.created", "response.queued"]
    started = response_events(_row("in_progress", in_progress_at=101))
    assert [e["type"] for e in started] == ["response.created", "response.queued", "response.in_progress"]
    assert started[0]["response"]["status"] == started[1]["response"]["status"] == "queued"
    assert started[2]["sequence_number"] == 2 and started[2]["response"]["status"] == "in_progress"


def test_a_completed_response_replays_every_item_and_its_text_word_by_word():
    events = response_events(_row("completed", in_progress_at=101, finished_at=102, output=OUTPUT))
    types = [e["type"] for e in events]
    assert types[:5] == ["response.created", "response.queued", "response.in_progress",
                         "response.output_item.added", "response.output_item.done"]
    assert types[-1] == "response.completed" and events[-1]["response"]["completed_at"] == 102
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["Otters ", "hold ", "hands."]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["output"] == [] and events[-1]["response"]["output"] == OUTPUT


def test_a_cancelled_response_ends_without_a_final_event():
    events = response_events(_row("cancelled", in_progress_at=101, finished_at=102))
    assert [e["type"] for e in events] == ["response.created", "response.queued", "response.in_progress"]

"""Background responses at the gateway, with the real ``openai`` client: created ``queued`` on the
async lane, taken by a processor (``in_progress``), ended by their result (the processor's part is
played here on the real Redis streams), cancelled, expired, chained, replayed as a stream,
refused over the tenant's quota, and scoped to their tenant."""

from __future__ import annotations

import httpx
import orjson
import pytest
import redis
from sqlalchemy import text, update

from batch_gateway.store import queries
from batch_gateway.store.models import BackgroundResponse, Event, Tenant
from common.contracts.background import ASYNC_LANE, response_result_stream
from common.contracts.queue import (
    PROCESSOR_GROUP,
    REQUEST_FIELD,
    RESULT_FIELD,
    ErrorCode,
    cancel_marker_key,
    decode_request,
    encode_result,
    error_result,
    http_result,
    request_stream,
)
from workers.responses import check_published, collect_responses, expire_responses, publish_unpublished
from workers.webhooks import event_body, new_secret

ADMIN_KEY = "admin-responses-" + "x" * 24


@pytest.fixture
def gateway_settings(gateway_settings):
    """The gateway publishing on the pool the test's worker reads (its task queue's name), with an
    admin key."""
    return gateway_settings.model_copy(update={"queue_pool": gateway_settings.task_queue, "admin_key": ADMIN_KEY})


class Processor:
    """The processor's side of the async lane, by hand: take messages, publish results."""

    def __init__(self, gateway):
        self.pool = gateway.settings.task_queue
        self.redis = redis.Redis.from_url(gateway.settings.redis_url)
        self.stream = request_stream(ASYNC_LANE, self.pool)
        self.redis.xgroup_create(self.stream, PROCESSOR_GROUP, id="0", mkstream=True)

    def take(self) -> list:
        """Every new message of the lane, read through the processors' group (now held)."""
        reply = self.redis.xreadgroup(PROCESSOR_GROUP, "test", {self.stream: ">"}, count=100) or []
        return [decode_request(fields[REQUEST_FIELD.encode()]) for _, entries in reply for _, fields in entries]

    def answer(self, message, result) -> None:
        assert message.result_queue_name == response_result_stream(self.pool)
        self.redis.xadd(message.result_queue_name, {RESULT_FIELD: encode_result(result)})

    def complete(self, message, text: str = "Otters float.", status: str = "completed") -> None:
        body = {"id": "resp_engine", "object": "response", "status": status, "model": message.payload["model"],
                "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                "usage": {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8},
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}
        self.answer(message, http_result(message, 200, orjson.dumps(body)))


@pytest.fixture
def processor(gateway):
    return Processor(gateway)


def _ctx(gateway):
    return gateway.celery.backfill


def test_created_queued_then_in_progress_then_completed(gateway, processor):
    client = gateway.client()
    created = client.responses.create(model="m", input="Write about otters.", background=True,
                                      instructions="Be brief.", metadata={"k": "v"})
    assert created.status == "queued" and created.background is True and created.id.startswith("resp_")
    assert created.output == [] and created.usage is None and created.error is None
    assert created.instructions == "Be brief." and created.metadata == {"k": "v"} and created.model == "m"

    [message] = processor.take()
    assert message.id == created.id and message.endpoint == "/v1/responses"
    assert message.metadata["tenant"].startswith("tenant_") and message.metadata["objective"] == "async"
    assert message.payload["input"] == [{"type": "message", "role": "user", "content": "Write about otters."}]
    assert message.payload["store"] is False and "background" not in message.payload
    assert abs(message.deadline - message.created - gateway.settings.background_queue_seconds) <= 1  # rounding

    assert check_published(_ctx(gateway)) == 1
    assert client.responses.retrieve(created.id).status == "in_progress"
    processor.complete(message)
    assert collect_responses(_ctx(gateway)) == 1
    done = client.responses.retrieve(created.id)
    assert done.status == "completed" and done.output_text == "Otters float."
    assert done.usage is not None and done.usage.total_tokens == 8
    assert collect_responses(_ctx(gateway)) == 0  # acknowledged: not read again


def test_failures_map_to_failed_and_incomplete(gateway, processor):
    client = gateway.client()
    first = client.responses.create(model="m", input="a", background=True)
    second = client.responses.create(model="m", input="b", background=True)
    third = client.responses.create(model="m", input="c", background=True)
    by_id = {m.id: m for m in processor.take()}
    processor.complete(by_id[first.id], status="incomplete")
    processor.answer(by_id[second.id], http_result(by_id[second.id], 404, orjson.dumps(
        {"error": {"message": "The model 'm' does not exist.", "type": "invalid_request_error", "param": "model",
                   "code": "model_not_found"}})))
    processor.answer(by_id[third.id], error_result(third.id, ErrorCode.INFERENCE_ERROR, "engine died",
                                                   by_id[third.id].metadata))
    assert collect_responses(_ctx(gateway)) == 3
    incomplete = client.responses.retrieve(first.id)
    assert incomplete.status == "incomplete" and incomplete.incomplete_details.reason == "max_output_tokens"
    failed = client.responses.retrieve(second.id)
    assert failed.status == "failed" and failed.error.code == "model_not_found"
    assert "does not exist" in failed.error.message
    assert client.responses.retrieve(third.id).error.message == "engine died"


def test_cancel_drops_the_message_and_discards_a_late_result(gateway, processor):
    client = gateway.client()
    created = client.responses.create(model="m", input="long", background=True)
    [message] = processor.take()
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert processor.redis.exists(cancel_marker_key(created.id))
    assert client.responses.cancel(created.id).status == "cancelled"  # again: the same object
    processor.complete(message)  # the run was not stopped in time: its result is discarded
    assert collect_responses(_ctx(gateway)) == 0
    assert client.responses.retrieve(created.id).status == "cancelled"

    finished = client.responses.create(model="m", input="short", background=True)
    processor.complete(processor.take()[0])
    collect_responses(_ctx(gateway))
    answer = gateway.http().post(f"/v1/responses/{finished.id}/cancel")
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "Cannot cancel a response with status 'completed'."


def test_other_tenants_and_unknown_ids_are_404(gateway):
    created = gateway.client().responses.create(model="m", input="mine", background=True)
    for path in (f"/v1/responses/{created.id}", "/v1/responses/resp_nope"):
        answer = gateway.http("other").get(path)
        assert answer.status_code == 404
        assert answer.json()["error"]["type"] == "invalid_request_error"
    assert gateway.http("other").post(f"/v1/responses/{created.id}/cancel").status_code == 404


def test_requests_it_does_not_serve_are_refused(gateway):
    http = gateway.http()
    for body, param in (({"model": "m", "input": "x"}, "background"),
                        ({"model": "m", "input": "x", "background": True, "stream": "yes"}, "stream"),
                        ({"model": "m", "input": "x", "background": True, "store": False}, "store"),
                        ({"input": "x", "background": True}, "model"),
                        ({"model": "m" * 257, "input": "x", "background": True}, "model"),
                        ({"model": "m", "input": 3, "background": True}, "input"),
                        ({"model": "m", "background": True}, "input"),
                        ({"model": "m", "input": "a\u0000b", "background": True}, None)):
        answer = http.post("/v1/responses", json=body)
        assert answer.status_code == 400, body
        assert answer.json()["error"]["param"] == param


def test_quota_of_queued_responses(gateway):
    client = gateway.client()
    with gateway.session() as session:
        session.execute(update(Tenant).where(Tenant.name == "default").values(queued_response_limit=1))
        session.commit()
    client.responses.create(model="m", input="one", background=True)
    answer = gateway.http().post("/v1/responses", json={"model": "m", "input": "two", "background": True})
    assert answer.status_code == 429
    assert answer.json()["error"]["code"] == "rate_limit_exceeded" and answer.headers["retry-after"]


def test_queued_too_long_expires_failed(gateway, processor):
    client = gateway.client()
    created = client.responses.create(model="m", input="x", background=True)
    with gateway.session() as session:
        session.execute(update(BackgroundResponse).where(BackgroundResponse.id == created.id)
                        .values(deadline=text("now() - interval '1 second'")))
        session.commit()
    assert expire_responses(_ctx(gateway)) == 1
    expired = client.responses.retrieve(created.id)
    assert expired.status == "failed" and expired.error.code == "rate_limit_exceeded"
    assert processor.redis.exists(cancel_marker_key(created.id))


def test_previous_response_id_chains_stored_responses(gateway, processor):
    client = gateway.client()
    first = client.responses.create(model="m", input="Name an otter.", background=True)
    processor.complete(processor.take()[0], text="Olive.")
    collect_responses(_ctx(gateway))
    second = client.responses.create(model="m", input="And another?", background=True, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    [message] = processor.take()
    items = message.payload["input"]
    assert [item.get("role") for item in items] == ["user", "assistant", "user"]
    assert items[1]["content"][0]["text"] == "Olive." and items[2]["content"] == "And another?"

    answer = gateway.http().post("/v1/responses", json={"model": "m", "input": "x", "background": True,
                                                        "previous_response_id": "resp_unknown"})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "previous_response_not_found"


def test_stream_replays_the_events_after_starting_after(gateway, processor):
    client = gateway.client()
    created = client.responses.create(model="m", input="x", background=True)
    processor.complete(processor.take()[0], text="Otters hold hands.")
    collect_responses(_ctx(gateway))
    events = list(client.responses.retrieve(created.id, stream=True))
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == "Otters hold hands."
    assert events[-1].response.output_text == "Otters hold hands."
    later = list(client.responses.retrieve(created.id, stream=True, starting_after=len(events) - 2))
    assert [event.type for event in later] == ["response.completed"]


def test_a_lost_publish_is_published_by_the_workers(gateway, processor):
    created = gateway.client().responses.create(model="m", input="x", background=True)
    processor.take()
    with gateway.session() as session:
        session.execute(update(BackgroundResponse).where(BackgroundResponse.id == created.id)
                        .values(queue_entry_id=None, created_at=BackgroundResponse.created_at - 60))
        session.commit()
    assert publish_unpublished(_ctx(gateway)) == 1
    assert [m.id for m in processor.take()] == [created.id]
    assert publish_unpublished(_ctx(gateway)) == 0


def test_ended_responses_are_webhook_events(gateway, processor):
    with gateway.session() as session:
        queries.set_webhook(session, "default", "http://127.0.0.1:9/hook", new_secret())
        session.commit()
    created = gateway.client().responses.create(model="m", input="x", background=True)
    processor.complete(processor.take()[0])
    collect_responses(_ctx(gateway))
    with gateway.session() as session:
        [event] = session.query(Event).filter(Event.type == "response.completed").all()
    assert event.webhook_next_at is not None  # due: delivered and signed as the batch events
    assert orjson.loads(event_body(event)[1])["data"] == {"id": created.id}


def test_admin_dashboard_lists_responses_newest_first_by_status(gateway, processor):
    client = gateway.client()
    ids = [client.responses.create(model="m", input=str(n), background=True).id for n in range(3)]
    client.responses.cancel(ids[0])
    admin = httpx.Client(base_url=gateway.base_url, timeout=30, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    listed = admin.get("/admin/api/responses").json()
    assert [row["id"] for row in listed["data"]] == ids[::-1] and listed["has_more"] is False
    assert [row["id"] for row in admin.get("/admin/api/responses", params={"status": "cancelled"}).json()["data"]] \
        == [ids[0]]
    page = admin.get("/admin/responses")
    assert page.status_code == 200 and all(response_id in page.text for response_id in ids)
    assert admin.get("/admin/responses", params={"status": "nope"}).status_code == 400


def test_a_message_lost_by_the_queue_is_published_again(gateway, processor):
    created = gateway.client().responses.create(model="m", input="x", background=True)
    [message] = processor.take()
    assert check_published(_ctx(gateway)) == 1  # held: in_progress
    processor.redis.delete(processor.stream)  # Redis lost the lane (and the processor's hold)
    processor.redis.xgroup_create(processor.stream, PROCESSOR_GROUP, id="0", mkstream=True)
    assert check_published(_ctx(gateway)) == 1
    assert [m.id for m in processor.take()] == [created.id]
    assert check_published(_ctx(gateway)) == 0  # held again: nothing to do


def test_delete_forgets_a_response_and_stops_an_open_one(gateway, processor):
    client = gateway.client()
    created = client.responses.create(model="m", input="x", background=True)
    [message] = processor.take()
    assert gateway.http("other").delete(f"/v1/responses/{created.id}").status_code == 404
    deleted = gateway.http().delete(f"/v1/responses/{created.id}")
    assert deleted.json() == {"id": created.id, "object": "response.deleted", "deleted": True}
    assert processor.redis.exists(cancel_marker_key(created.id))
    processor.complete(message)
    assert collect_responses(_ctx(gateway)) == 0  # nothing left to end
    assert gateway.http().get(f"/v1/responses/{created.id}").status_code == 404


def test_gateway_metrics_count_responses_by_status_and_the_oldest_queued_wait(gateway, processor):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, dict[tuple, float]]:
        answer = httpx.get(gateway.base_url + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
        assert answer.status_code == 200
        return {family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
                for family in text_string_to_metric_families(answer.text)}

    client = gateway.client()
    waiting = client.responses.create(model="m", input="one", background=True)
    running = client.responses.create(model="m", input="two", background=True)
    cancelled = client.responses.create(model="m", input="three", background=True)
    client.responses.cancel(cancelled.id)
    processor.take()
    with gateway.session() as session:
        session.execute(update(BackgroundResponse).where(BackgroundResponse.id == waiting.id)
                        .values(created_at=BackgroundResponse.created_at - 120))
        session.execute(update(BackgroundResponse).where(BackgroundResponse.id == running.id)
                        .values(status="in_progress", in_progress_at=BackgroundResponse.created_at))
        session.commit()
    after = scrape()  # the first scrape of this gateway: the gauges' cached read is made now
    counts = {labels[0][1]: value for labels, value in after["backfill_gateway_background_responses"].items()}
    assert counts == {"queued": 1, "in_progress": 1, "cancelled": 1, "completed": 0, "failed": 0, "incomplete": 0}
    assert 120 <= after["backfill_gateway_background_responses_oldest_queued_seconds"][()] < 200
    assert after["backfill_gateway_background_responses_created"][()] == 3


@pytest.mark.parametrize(("items", "param", "code"), [
    ([], "input", "empty_array"),
    (["hi"], "input[0]", "invalid_type"),
    ([{"role": "user", "content": "a"}, {"type": 3}], "input[1].type", "invalid_type"),
    ([{"content": "a"}], "input[0].role", "missing_required_parameter"),
    ([{"role": "robot", "content": "a"}], "input[0].role", "invalid_value"),
    ([{"type": "message", "role": "user"}], "input[0].content", "missing_required_parameter"),
    ([{"role": "user", "content": 5}], "input[0].content", "invalid_type"),
    ([{"role": "user", "content": [{"text": "a"}]}], "input[0].content[0].type", "missing_required_parameter"),
    ([{"role": "user", "content": [{"type": "input_text", "text": 1}]}], "input[0].content[0].text", "invalid_type"),
])
def test_input_items_are_checked_at_create_as_openai_names_the_param(gateway, items, param, code):
    answer = gateway.http().post("/v1/responses", json={"model": "m", "input": items, "background": True})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error


def test_input_items_in_list_form_reach_the_engine_as_sent(gateway, processor):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Otters?"}]},
             {"type": "function_call_output", "call_id": "call_1", "output": "{}"}]
    created = gateway.client().responses.create(model="m", input=items, background=True)
    [message] = processor.take()
    assert message.id == created.id and message.payload["input"] == items


def test_stream_at_create_answers_the_events_from_created_and_follows_to_the_end(gateway, processor):
    client = gateway.client()
    stream = client.responses.create(model="m", input="Stream it.", background=True, stream=True)
    events = iter(stream)
    first, second = next(events), next(events)
    assert first.type == "response.created" and first.sequence_number == 0
    assert first.response.status == "queued" and first.response.background is True
    assert second.type == "response.queued" and second.sequence_number == 1
    [message] = processor.take()
    assert message.id == first.response.id
    check_published(_ctx(gateway))
    processor.complete(message, text="Otters stream.")
    collect_responses(_ctx(gateway))
    rest = list(events)
    assert [e.type for e in rest][0] == "response.in_progress" and rest[-1].type == "response.completed"
    assert [e.sequence_number for e in rest] == list(range(2, 2 + len(rest)))
    assert "".join(e.delta for e in rest if e.type == "response.output_text.delta") == "Otters stream."
    resumed = list(client.responses.retrieve(first.response.id, stream=True, starting_after=rest[-2].sequence_number))
    assert [e.type for e in resumed] == ["response.completed"]

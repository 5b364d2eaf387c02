"""Output and error lines rendered from request rows (``workers.output``), no database."""

from __future__ import annotations

import orjson
import pytest

from workers.output import NO_RESPONSE_MESSAGES, RequestOutcome, error_body, json_body, render_line, request_line_id

LINE_ID = "batch_req_250e949c90b7193a7a9367e3"  # sha256("batch_1\x00c1")[:24], computed once by hand
CHAT = {"endpoint": "/v1/chat/completions", "model": "m"}


def test_line_id_is_derived_from_batch_and_custom_id():
    assert request_line_id("batch_1", "c1") == LINE_ID
    assert request_line_id("batch_1", "c1") == request_line_id("batch_1", "c1")
    assert request_line_id("batch_2", "c1") != LINE_ID
    assert len(request_line_id("b", "x")) == len("batch_req_") + 24


def test_a_response_line_copies_the_body_byte_for_byte():
    body = b'{"id":"chatcmpl-1", "object":"chat.completion"}'  # the space is kept: no re-encoding
    line = render_line("batch_1", RequestOutcome("c1", 200, "req-9", body, None), **CHAT)
    assert line == (b'{"id":"' + LINE_ID.encode() + b'","custom_id":"c1","response":{"status_code":200,'
                    b'"request_id":"req-9","body":{"id":"chatcmpl-1", "object":"chat.completion"}},"error":null}\n')
    assert orjson.loads(line)["response"]["body"]["id"] == "chatcmpl-1"


def test_an_http_error_keeps_error_null_and_a_missing_body_or_id_is_filled():
    line = orjson.loads(render_line("batch_1", RequestOutcome("c1", 404, None, None, None), **CHAT))
    assert line == {"id": LINE_ID, "custom_id": "c1",
                    "response": {"status_code": 404, "request_id": "",
                                 "body": {"error": {"message": "HTTP 404", "type": "invalid_request_error",
                                                    "param": None, "code": None}}}, "error": None}


def test_an_engine_error_is_written_in_openai_s_words():
    vllm = (b'{"error": {"message": "\'max_tokens\' or \'max_completion_tokens\' is too large: 8000. This '
            b'model\'s maximum context length is 4096 tokens and your request has 2778 input tokens (8000 > '
            b'4096 - 2778).", "type": "BadRequestError", "param": "max_tokens", "code": 400}}')
    line = orjson.loads(render_line("batch_1", RequestOutcome("c1", 400, None, vllm, None), **CHAT))
    error = line["response"]["body"]["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                              "messages")
    assert error["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large: 8000.")
    assert line["error"] is None and line["response"]["status_code"] == 400


def test_vllm_0_32_s_max_tokens_over_max_model_len_is_openai_s_context_length_exceeded():
    # OpenAI answers max_tokens 1000000 on a 128k model with code context_length_exceeded, param messages
    vllm = (b'{"error": {"message": "max_tokens=1000000 cannot be greater than max_model_len=131072. Please '
            b'request fewer output tokens. (parameter=max_tokens, value=1000000)", "type": "BadRequestError", '
            b'"param": "max_tokens", "code": 400}}')
    error = orjson.loads(render_line("batch_1", RequestOutcome("c1", 400, None, vllm, None), **CHAT))
    assert (error["response"]["body"]["error"]["code"], error["response"]["body"]["error"]["param"]) == \
        ("context_length_exceeded", "messages")


def test_an_error_already_in_openai_s_words_is_copied_byte_for_byte():
    body = b'{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": "unknown_url"}}'
    assert error_body(404, body, **CHAT) == body
    line = render_line("batch_1", RequestOutcome("c1", 404, None, body, None), **CHAT)
    assert body in line


def test_an_endpoint_the_engine_lacks_names_the_endpoint_and_the_model():
    body = orjson.loads(error_body(404, b'{"detail":"Not Found"}', endpoint="/v1/responses", model="llama-3"))
    error = body["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")
    assert "/v1/responses" in error["message"] and "'llama-3'" in error["message"]
    assert "404 Not Found" in error["message"]


def test_no_response_gives_a_top_level_error_with_the_default_or_given_message():
    line = orjson.loads(render_line("batch_1", RequestOutcome("c1", None, None, None, "batch_expired"), **CHAT))
    assert line == {"id": LINE_ID, "custom_id": "c1", "response": None,
                    "error": {"code": "batch_expired", "message": NO_RESPONSE_MESSAGES["batch_expired"]}}
    line = orjson.loads(render_line("batch_1", RequestOutcome("c1", 0, None, None, "batch_failed", "boom"), **CHAT))
    assert line["error"] == {"code": "batch_failed", "message": "boom"}
    line = orjson.loads(render_line("batch_1", RequestOutcome("c1", None, None, None, "weird_code"), **CHAT))
    assert line["error"] == {"code": "weird_code", "message": "weird_code"}


def test_an_outcome_with_neither_response_nor_error_is_refused():
    with pytest.raises(ValueError, match="neither a response nor an error"):
        render_line("batch_1", RequestOutcome("c1", None, None, None, None), **CHAT)


def test_custom_ids_are_json_escaped():
    line = render_line("b", RequestOutcome('a"\n\\b', None, None, None, "batch_cancelled"), **CHAT)
    assert orjson.loads(line)["custom_id"] == 'a"\n\\b'
    assert line.count(b"\n") == 1 and line.endswith(b"\n")


@pytest.mark.parametrize(("status", "succeeded"), [(200, True), (299, True), (300, False), (500, False),
                                                   (0, False), (None, False)])
def test_only_2xx_succeeds(status, succeeded):
    assert RequestOutcome("c", status, None, None, "x").succeeded is succeeded


def test_json_body_keeps_json_and_wraps_anything_else():
    assert json_body(b'{"a": 1}', 200) == b'{"a": 1}'
    assert json_body('["x"]', 200) == b'["x"]'
    assert orjson.loads(json_body(b"<html>bad gateway</html>", 502)) == {
        "error": {"message": "<html>bad gateway</html>", "type": "server_error", "param": None, "code": None}}
    assert orjson.loads(json_body(None, 500))["error"]["message"] == "HTTP 500 with an empty body"
    assert orjson.loads(json_body(b"", 404))["error"] == {
        "message": "HTTP 404 with an empty body", "type": "invalid_request_error", "param": None, "code": None}
    assert len(orjson.loads(json_body(b"x" * 5000, 503))["error"]["message"]) == 2000
    assert orjson.loads(json_body(b"\xff oops", 400))["error"]["message"] == "\ufffd oops"

"""Output and error lines rendered from request rows (``workers.output``), no database."""

from __future__ import annotations

import orjson
import pytest

from workers.output import NO_RESPONSE_MESSAGES, RequestOutcome, json_body, render_line, request_line_id

LINE_ID = "batch_req_250e949c90b7193a7a9367e3"  # sha256("batch_1\x00c1")[:24], computed once by hand


def test_line_id_is_derived_from_batch_and_custom_id():
    assert request_line_id("batch_1", "c1") == LINE_ID
    assert request_line_id("batch_1", "c1") == request_line_id("batch_1", "c1")
    assert request_line_id("batch_2", "c1") != LINE_ID
    assert len(request_line_id("b", "x")) == len("batch_req_") + 24


def test_a_response_line_copies_the_body_byte_for_byte():
    body = b'{"id":"chatcmpl-1", "object":"chat.completion"}'  # the space is kept: no re-encoding
    line = render_line("batch_1", RequestOutcome("c1", 200, "req-9", body, None))
    assert line == (b'{"id":"' + LINE_ID.encode() + b'","custom_id":"c1","response":{"status_code":200,'
                    b'"request_id":"req-9","body":{"id":"chatcmpl-1", "object":"chat.completion"}},"error":null}\n')
    assert orjson.loads(line)["response"]["body"]["id"] == "chatcmpl-1"


def test_an_http_error_keeps_error_null_and_a_missing_body_or_id_is_filled():
    line = orjson.loads(render_line("batch_1", RequestOutcome("c1", 404, None, None, None)))
    assert line == {"id": LINE_ID, "custom_id": "c1",
                    "response": {"status_code": 404, "request_id": "", "body": None}, "error": None}


def test_no_response_gives_a_top_level_error_with_the_default_or_given_message():
    line = orjson.loads(render_line("batch_1", RequestOutcome("c1", None, None, None, "batch_expired")))
    assert line == {"id": LINE_ID, "custom_id": "c1", "response": None,
                    "error": {"code": "batch_expired", "message": NO_RESPONSE_MESSAGES["batch_expired"]}}
    line = orjson.loads(render_line("batch_1", RequestOutcome("c1", 0, None, None, "batch_failed", "boom")))
    assert line["error"] == {"code": "batch_failed", "message": "boom"}
    line = orjson.loads(render_line("batch_1", RequestOutcome("c1", None, None, None, "weird_code")))
    assert line["error"] == {"code": "weird_code", "message": "weird_code"}


def test_an_outcome_with_neither_response_nor_error_is_refused():
    with pytest.raises(ValueError, match="neither a response nor an error"):
        render_line("batch_1", RequestOutcome("c1", None, None, None, None))


def test_custom_ids_are_json_escaped():
    line = render_line("b", RequestOutcome('a"\n\\b', None, None, None, "batch_cancelled"))
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

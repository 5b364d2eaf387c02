"""router.parsing: every path, header rule, bad body, and the bodies the router sends to engines."""

from __future__ import annotations

import itertools

import orjson
import pytest

from common.chatml import render_chat
from router.parsing import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    EMBEDDINGS_PATH,
    RESPONSES_PATH,
    ParsedRequest,
    RequestError,
    engine_body,
    engine_priority,
    parse_request,
    with_engine_priority,
    with_stream_usage,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def parse(path: str, body: dict | bytes, headers: dict[str, str] | None = None) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(path, raw, headers or {})


def refused(path: str, body: dict | bytes, headers: dict[str, str] | None = None) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(path, body, headers)
    return info.value


# ---- paths -------------------------------------------------------------------------------------
def test_chat_renders_chatml_and_reads_the_fields():
    body = {"model": "m", "messages": MESSAGES, "stream": True, "max_completion_tokens": 7, "max_tokens": 99,
            "cache_salt": "salt-1"}
    parsed = parse(CHAT_PATH, body)
    assert parsed.kind == "chat"
    assert parsed.prompt_text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert parsed.messages == MESSAGES
    assert parsed.prompt_token_ids is None
    assert (parsed.model, parsed.stream, parsed.max_tokens, parsed.cache_salt) == ("m", True, 7, "salt-1")
    assert parsed.body == body
    assert parsed.raw == orjson.dumps(body)


def test_chat_max_tokens_when_no_max_completion_tokens_and_generation_prompt_off():
    parsed = parse(CHAT_PATH, {"model": "m", "messages": MESSAGES, "max_tokens": 5, "add_generation_prompt": False})
    assert parsed.max_tokens == 5
    assert parsed.prompt_text == render_chat(MESSAGES, add_generation_prompt=False)
    assert not parsed.prompt_text.endswith("<|im_start|>assistant\n")
    assert parse(CHAT_PATH, {"model": "m", "messages": MESSAGES}).max_tokens is None


def test_chat_list_contents_keep_their_text_parts():
    messages = [{"role": "user", "content": [{"type": "text", "text": "look: "},
                                             {"type": "image_url", "image_url": {"url": "http://x/i.png"}},
                                             {"type": "text", "text": "a cat"}]}]
    parsed = parse(CHAT_PATH, {"model": "m", "messages": messages})
    assert parsed.prompt_text == "<|im_start|>user\nlook: a cat<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("prompt", "text", "ids"), [
    ("Once upon", "Once upon", None),
    (["first", "second"], "first\nsecond", None),
    ([1, 2, 3], "", [1, 2, 3]),
    ([[1, 2], [3], [4, 5]], "", [1, 2, 3, 4, 5]),
    ([0, 2**32 - 1], "", [0, 2**32 - 1]),
])
def test_completions_prompt_shapes(prompt, text, ids):
    parsed = parse(COMPLETIONS_PATH, {"model": "m", "prompt": prompt, "max_tokens": 3})
    assert parsed.kind == "completion"
    assert parsed.prompt_text == text
    assert (None if parsed.prompt_token_ids is None else list(parsed.prompt_token_ids)) == ids
    assert parsed.max_tokens == 3
    assert parsed.messages is None


@pytest.mark.parametrize(("value", "text", "ids"), [
    ("hello world", "hello world", None),
    (["a", "b"], "a\nb", None),
    ([7, 8], "", [7, 8]),
])
def test_embeddings_input_shapes(value, text, ids):
    parsed = parse(EMBEDDINGS_PATH, {"model": "e", "input": value, "stream": True})
    assert parsed.kind == "embedding"
    assert parsed.prompt_text == text
    assert (None if parsed.prompt_token_ids is None else list(parsed.prompt_token_ids)) == ids
    assert parsed.stream is False  # embeddings never stream
    assert parsed.max_tokens is None


def test_responses_string_input_with_instructions():
    parsed = parse(RESPONSES_PATH, {"model": "m", "instructions": "Be brief.", "input": "What is 2+2?",
                                    "max_output_tokens": 11})
    assert parsed.kind == "response"
    assert parsed.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert parsed.prompt_text == render_chat(MESSAGES)
    assert parsed.max_tokens == 11


def test_responses_items_render_like_chat_and_skip_non_message_items():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "function_call_output", "call_id": "c1", "output": "42"},
             {"type": "message", "role": "assistant", "content": "hello"}]
    parsed = parse(RESPONSES_PATH, {"model": "m", "input": items})
    assert parsed.prompt_text == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
                                  "<|im_start|>assistant\n")


def test_unsupported_path_is_404():
    error = refused("/v1/models", {"model": "m"})
    assert (error.status, error.code, error.param) == (404, "unknown_url", None)
    assert "/v1/models" in error.message


# ---- headers -----------------------------------------------------------------------------------
def chat_with(headers: dict[str, str]) -> ParsedRequest:
    return parse(CHAT_PATH, {"model": "m", "messages": MESSAGES}, headers)


def test_llm_d_headers_are_read_case_insensitively():
    parsed = chat_with({"X-LLM-D-Inference-Objective": "batch", "X-Llm-D-Inference-Fairness-Id": "tenant-a",
                        "X-LLM-D-SLO-TTFT-MS": "1500.5", "X-Session-Id": "s-1", "X-Request-Id": "req-9",
                        "Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    assert (parsed.objective, parsed.fairness_id, parsed.slo_ttft_ms) == ("batch", "tenant-a", 1500.5)
    assert (parsed.session_id, parsed.request_id) == ("s-1", "req-9")
    assert parsed.traceparent == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_legacy_gateway_headers_are_used_only_without_the_llm_d_ones():
    legacy = {"x-gateway-inference-objective": "async", "x-gateway-inference-fairness-id": "old-tenant"}
    parsed = chat_with(legacy)
    assert (parsed.objective, parsed.fairness_id) == ("async", "old-tenant")
    parsed = chat_with({**legacy, "x-llm-d-inference-objective": "interactive",
                        "x-llm-d-inference-fairness-id": "new-tenant"})
    assert (parsed.objective, parsed.fairness_id) == ("interactive", "new-tenant")


def test_absent_headers_give_none_and_a_fresh_uuid4_request_id():
    first, second = chat_with({}), chat_with({"x-llm-d-inference-objective": "  "})
    for parsed in (first, second):
        assert (parsed.objective, parsed.fairness_id, parsed.slo_ttft_ms) == (None, None, None)
        assert (parsed.session_id, parsed.traceparent, parsed.cache_salt) == (None, None, None)
        assert len(parsed.request_id) == 32 and int(parsed.request_id, 16) >= 0
        assert parsed.request_id[12] == "4"  # uuid version 4
    assert first.request_id != second.request_id


@pytest.mark.parametrize("header", ["x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"])
def test_fairness_id_up_to_256_bytes(header):
    assert chat_with({header: "t" * 256}).fairness_id == "t" * 256
    assert chat_with({header: "é" * 128}).fairness_id == "é" * 128  # 256 bytes in UTF-8
    for too_long in ("t" * 257, "é" * 128 + "t"):
        error = refused(CHAT_PATH, {"model": "m", "messages": MESSAGES}, {header: too_long})
        assert (error.status, error.param, error.code) == (400, header, "invalid_value")


@pytest.mark.parametrize("value", ["0", "12", "2.5", " 300 ", "1e3"])
def test_slo_ttft_accepts_non_negative_numbers(value):
    assert chat_with({"x-llm-d-slo-ttft-ms": value}).slo_ttft_ms == float(value)


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf", "-inf", "1,5", "0x10"])
def test_slo_ttft_garbage_is_400(value):
    error = refused(CHAT_PATH, {"model": "m", "messages": MESSAGES}, {"x-llm-d-slo-ttft-ms": value})
    assert (error.status, error.param, error.code) == (400, "x-llm-d-slo-ttft-ms", "invalid_value")


# ---- bad bodies --------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "param", "code"), [
    (CHAT_PATH, b"", None, "invalid_json"),
    (CHAT_PATH, b"{not json", None, "invalid_json"),
    (CHAT_PATH, b"\xff\xfe", None, "invalid_json"),
    (CHAT_PATH, b"[1, 2]", None, "invalid_type"),
    (CHAT_PATH, b'"model"', None, "invalid_type"),
    (CHAT_PATH, b"null", None, "invalid_type"),
    (CHAT_PATH, {"messages": MESSAGES}, "model", "missing_required_parameter"),
    (CHAT_PATH, {"model": 3, "messages": MESSAGES}, "model", "invalid_type"),
    (CHAT_PATH, {"model": "", "messages": MESSAGES}, "model", "invalid_value"),
    (CHAT_PATH, {"model": "m"}, "messages", "missing_required_parameter"),
    (CHAT_PATH, {"model": "m", "messages": "hi"}, "messages", "invalid_type"),
    (CHAT_PATH, {"model": "m", "messages": []}, "messages", "invalid_value"),
    (CHAT_PATH, {"model": "m", "messages": ["hi"]}, "messages[0]", "invalid_type"),
    (CHAT_PATH, {"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter"),
    (CHAT_PATH, {"model": "m", "messages": [{"role": 1, "content": "hi"}]}, "messages[0].role", "invalid_type"),
    (CHAT_PATH, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    (CHAT_PATH, {"model": "m", "messages": MESSAGES, "stream": "yes"}, "stream", "invalid_type"),
    (CHAT_PATH, {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": 1}, "stream_options",
     "invalid_type"),
    (CHAT_PATH, {"model": "m", "messages": MESSAGES, "max_tokens": "9"}, "max_tokens", "invalid_type"),
    (CHAT_PATH, {"model": "m", "messages": MESSAGES, "max_completion_tokens": -1}, "max_completion_tokens",
     "invalid_value"),
    (CHAT_PATH, {"model": "m", "messages": MESSAGES, "add_generation_prompt": 1}, "add_generation_prompt",
     "invalid_type"),
    (CHAT_PATH, {"model": "m", "messages": MESSAGES, "cache_salt": ""}, "cache_salt", "invalid_value"),
    (CHAT_PATH, {"model": "m", "messages": MESSAGES, "cache_salt": 7}, "cache_salt", "invalid_value"),
    (COMPLETIONS_PATH, {"model": "m"}, "prompt", "missing_required_parameter"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": 42}, "prompt", "invalid_type"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": []}, "prompt", "invalid_value"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": ["a", 1]}, "prompt", "invalid_type"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": [1, "a"]}, "prompt", "invalid_type"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": [1, 2.5]}, "prompt", "invalid_type"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": [1, -2]}, "prompt", "invalid_value"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": [2**32]}, "prompt", "invalid_value"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": [[1], 2]}, "prompt[1]", "invalid_type"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": [[1], ["x"]]}, "prompt[1]", "invalid_type"),
    (COMPLETIONS_PATH, {"model": "m", "prompt": [{"a": 1}]}, "prompt", "invalid_type"),
    (EMBEDDINGS_PATH, {"model": "m"}, "input", "missing_required_parameter"),
    (EMBEDDINGS_PATH, {"model": "m", "input": {"text": "x"}}, "input", "invalid_type"),
    (RESPONSES_PATH, {"model": "m"}, "input", "missing_required_parameter"),
    (RESPONSES_PATH, {"model": "m", "input": 3}, "input", "invalid_type"),
    (RESPONSES_PATH, {"model": "m", "input": []}, "input", "invalid_value"),
    (RESPONSES_PATH, {"model": "m", "input": ["hi"]}, "input[0]", "invalid_type"),
    (RESPONSES_PATH, {"model": "m", "input": "hi", "instructions": ["x"]}, "instructions", "invalid_type"),
    (RESPONSES_PATH, {"model": "m", "input": "hi", "max_output_tokens": 1.5}, "max_output_tokens", "invalid_type"),
])
def test_bad_bodies_are_400_with_the_param(path, body, param, code):
    error = refused(path, body)
    assert (error.status, error.param, error.code, error.type) == (400, param, code, "invalid_request_error")
    envelope = orjson.loads(error.envelope())
    assert envelope == {"error": {"message": error.message, "type": "invalid_request_error", "param": param,
                                  "code": code}}
    assert error.message


ODD_VALUES = [None, True, False, 0, -1, 1.5, 2**40, "", "x", [], [None], [1], ["a"], [[1]], [[]], [{}],
              [{"role": "user"}], {}, {"a": 1}, {"include_usage": "yes"}]
FIELDS = {
    CHAT_PATH: ({"model": "m", "messages": MESSAGES},
                ["model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                 "add_generation_prompt", "cache_salt"]),
    COMPLETIONS_PATH: ({"model": "m", "prompt": "p"}, ["model", "prompt", "stream", "stream_options", "max_tokens",
                                                       "cache_salt"]),
    EMBEDDINGS_PATH: ({"model": "m", "input": "p"}, ["model", "input", "cache_salt"]),
    RESPONSES_PATH: ({"model": "m", "input": "p"}, ["model", "input", "instructions", "max_output_tokens",
                                                    "stream"]),
}


@pytest.mark.parametrize("path", list(FIELDS))
def test_any_odd_field_value_is_parsed_or_refused_with_400_never_another_exception(path):
    base, fields = FIELDS[path]
    outcomes = set()
    for field, value in itertools.product(fields, ODD_VALUES):
        try:
            parsed = parse(path, {**base, field: value})
        except RequestError as error:
            assert error.status == 400, (field, value)
            assert error.param is None or error.param.split("[")[0].split(".")[0] == field, (field, value, error.param)
            outcomes.add("refused")
        else:
            assert isinstance(parsed.prompt_text, str)
            outcomes.add("parsed")
    assert outcomes == {"parsed", "refused"}


# ---- bodies for the engine ---------------------------------------------------------------------
def test_engine_priority_is_the_negated_objective_priority():
    assert [engine_priority(p) for p in (100, 0, -50)] == [-100, 0, 50]
    # a more important objective must run earlier under vLLM's lower-first policy
    assert engine_priority(100) < engine_priority(-100)



def test_with_engine_priority_writes_vllm_priority_and_keeps_the_rest():
    body = {"model": "m", "messages": MESSAGES, "temperature": 0.2}
    parsed = parse(CHAT_PATH, body)
    out = orjson.loads(with_engine_priority(parsed, engine_priority(10)))
    assert out == {**body, "priority": -10}
    assert parsed.body == body  # not mutated


def test_with_engine_priority_overrides_a_client_priority_and_keeps_raw_bytes_when_nothing_changes():
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}]}'
    parsed = parse_request(CHAT_PATH, raw, {})
    assert with_engine_priority(parsed, 0) is raw  # 0 is vLLM's default: forward the original bytes
    client = parse(CHAT_PATH, {"model": "m", "messages": MESSAGES, "priority": -1000})
    assert orjson.loads(with_engine_priority(client, 0))["priority"] == 0
    assert orjson.loads(with_engine_priority(client, 5))["priority"] == 5


@pytest.mark.parametrize("path,base", [(CHAT_PATH, {"model": "m", "messages": MESSAGES}),
                                       (COMPLETIONS_PATH, {"model": "m", "prompt": "p"})])
def test_with_stream_usage_asks_for_usage_on_streams_only(path, base):
    streaming = parse(path, {**base, "stream": True, "stream_options": {"continuous_usage_stats": False}})
    assert streaming.stream_include_usage is False
    out = orjson.loads(with_stream_usage(streaming))
    assert out["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert {k: v for k, v in out.items() if k != "stream_options"} == {**base, "stream": True}
    asked = parse(path, {**base, "stream": True, "stream_options": {"include_usage": True}})
    assert asked.stream_include_usage is True
    assert with_stream_usage(asked) is asked.raw
    not_streaming = parse(path, base)
    assert with_stream_usage(not_streaming) is not_streaming.raw


def test_with_stream_usage_leaves_responses_and_embeddings_alone():
    for path, body in ((RESPONSES_PATH, {"model": "m", "input": "p", "stream": True}),
                       (EMBEDDINGS_PATH, {"model": "m", "input": "p"})):
        parsed = parse(path, body)
        assert with_stream_usage(parsed) is parsed.raw


def test_engine_body_applies_priority_and_usage_in_one_body():
    parsed = parse(CHAT_PATH, {"model": "m", "messages": MESSAGES, "stream": True})
    out = orjson.loads(engine_body(parsed, priority=engine_priority(3), stream_usage=True))
    assert (out["priority"], out["stream_options"]) == (-3, {"include_usage": True})


def test_engine_body_drops_a_clients_kv_transfer_params():
    forged = {"do_remote_prefill": True, "remote_engine_id": "other", "remote_block_ids": [[1, 2]],
              "remote_host": "10.0.0.9", "remote_port": 5600, "remote_request_id": "r"}
    parsed = parse(COMPLETIONS_PATH, {"model": "m", "prompt": "p", "kv_transfer_params": forged})
    assert orjson.loads(engine_body(parsed)) == {"model": "m", "prompt": "p"}
    assert orjson.loads(with_engine_priority(parsed, 5)) == {"model": "m", "prompt": "p", "priority": 5}
    assert parsed.body["kv_transfer_params"] == forged  # the parsed request is not mutated

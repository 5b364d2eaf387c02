"""OpenAI's error envelope and the ``type`` vocabulary of every error this project answers.

The one shape every HTTP error of the gateway, the router and the engine twin takes (OpenAI's
API reference, "Error codes"; ``../shared/contracts/openai-batch.md``)::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

``type`` comes from :class:`ErrorType`. OpenAI's own words are used for everything the gateway
and the router decide themselves; vLLM's words (``BadRequestError``, ``NotFoundError``,
``RateLimitError``, ``ServiceUnavailableError``, …) are kept where this project stands in for a
vLLM engine (the engine twin, whose format is ``../shared/contracts/vllm-engine.md``) and for the
router's flow-control refusals, which llm-d's router writes in vLLM's words. vLLM's envelope
carries the HTTP status as an integer ``code``.

Errors that reach a batch's error file are put in OpenAI's words by :func:`openai_error`, with the
one table :data:`ENGINE_ERRORS` (vLLM's ``{"type": "BadRequestError", "code": 400}`` becomes e.g.
OpenAI's ``{"type": "invalid_request_error", "code": "context_length_exceeded", "param":
"messages"}``), so one error file speaks one vocabulary whoever refused the line.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final

import orjson


class ErrorType(enum.StrEnum):
    """Every ``type`` an error envelope of this project carries."""

    # OpenAI's vocabulary (gateway, router)
    INVALID_REQUEST = "invalid_request_error"
    """4xx caused by the request: bad arguments, unknown object, bad key, too large."""
    RATE_LIMIT = "rate_limit_error"
    """429 from the router (capacity), or a rate-limit Starlette raised."""
    TOKENS = "tokens"
    """429 of an enqueued-token quota (OpenAI's ``token_limit_exceeded``)."""
    SERVER = "server_error"
    """5xx: the upstream engine failed or the router could not complete the request."""
    API = "api_error"
    """500: a bug; never raised on purpose."""

    # vLLM's vocabulary (engine twin; router flow-control refusals)
    VLLM_BAD_REQUEST = "BadRequestError"
    VLLM_BAD_REQUEST_BODY = "Bad Request"
    """FastAPI's request-validation failure as vLLM answers it (a body that is not JSON)."""
    VLLM_NOT_FOUND = "NotFoundError"
    VLLM_RATE_LIMIT = "RateLimitError"
    VLLM_SERVICE_UNAVAILABLE = "ServiceUnavailableError"
    VLLM_INTERNAL = "InternalServerError"


def openai_type_for_status(status: int) -> ErrorType:
    """OpenAI's ``type`` for an HTTP status an error has no more specific type for: 429 →
    ``rate_limit_error``, other 4xx → ``invalid_request_error``, 5xx → ``server_error``."""
    if status == 429:
        return ErrorType.RATE_LIMIT
    return ErrorType.INVALID_REQUEST if status < 500 else ErrorType.SERVER


def vllm_type_for_status(status: int) -> ErrorType:
    """vLLM's ``type`` for an HTTP status (``vllm/entrypoints/openai/protocol.py`` ``ErrorResponse``
    names the exception class): 400, 404, 429, 503, and ``InternalServerError`` for anything else."""
    return {400: ErrorType.VLLM_BAD_REQUEST, 404: ErrorType.VLLM_NOT_FOUND, 429: ErrorType.VLLM_RATE_LIMIT,
            503: ErrorType.VLLM_SERVICE_UNAVAILABLE}.get(status, ErrorType.VLLM_INTERNAL)


def error_envelope(message: str, type: str, param: str | None = None,
                   code: str | int | None = None) -> dict[str, Any]:
    """The envelope as a dict: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": str(type), "param": param, "code": code}}


def error_json(message: str, type: str, param: str | None = None,
               code: str | int | None = None) -> bytes:
    """The envelope as JSON bytes (UTF-8)."""
    return orjson.dumps(error_envelope(message, type, param, code))


# --------------------------------------------------------------------------------------------------
# Engine errors in OpenAI's words

PROMPT_PARAM: Final[dict[str, str]] = {
    "/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/embeddings": "input",
    "/v1/responses": "input", "/v1/moderations": "input"}
"""The request field OpenAI names (``param``) in a ``context_length_exceeded`` error, by endpoint
(``messages`` for Chat Completions, as in OpenAI's own error lines: openai/openai-openapi#302)."""

KEEP: Final = "<keep>"
"""``EngineErrorRule.param``: the engine's own ``param`` (or the ``(parameter=…)`` vLLM writes into
its message), else null."""
PROMPT: Final = "<prompt>"
"""``EngineErrorRule.param``: the endpoint's prompt field (:data:`PROMPT_PARAM`)."""

OPENAI_TYPES: Final = frozenset({ErrorType.INVALID_REQUEST, ErrorType.RATE_LIMIT, ErrorType.TOKENS,
                                 ErrorType.SERVER, ErrorType.API})
"""``type`` values that are OpenAI's words: an error with one of them and a string ``code`` (the
router's and the gateway's own errors) is kept as it is."""


@dataclass(frozen=True, slots=True)
class EngineErrorRule:
    """One row of :data:`ENGINE_ERRORS`: an engine error with an HTTP status in ``statuses`` and,
    when ``pattern`` is set, a message it matches (searched, case-insensitive) becomes OpenAI's
    ``type`` and ``code``; ``param`` is a field name, :data:`KEEP`, :data:`PROMPT` or None (null);
    ``message`` (None: the engine's message) may use ``{endpoint}``, ``{model}``, ``{status}`` and
    ``{detail}`` (the engine's message)."""

    code: str | None
    type: ErrorType
    statuses: Collection[int]
    pattern: re.Pattern[str] | None = None
    param: str | None = KEEP
    message: str | None = None

    def matches(self, status: int, message: str) -> bool:
        """True when this row applies to an error of HTTP ``status`` with ``message``."""
        return status in self.statuses and (self.pattern is None or self.pattern.search(message) is not None)


def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


_CLIENT = range(400, 500)
_BAD_REQUEST = frozenset({400, 422})  # FastAPI answers a body it cannot validate with 422

ENGINE_ERRORS: Final[tuple[EngineErrorRule, ...]] = (
    # vLLM: "This model's maximum context length is 4096 tokens. However, your request has 5000 input
    # tokens…"; "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context
    # length is 4096 tokens…"; "The decoder prompt (length 5000) is longer than the maximum model length
    # of 4096."; "Prompt length of 5000 is longer than the maximum model length of 4096."; vLLM 0.32:
    # "max_tokens=1000000 cannot be greater than max_model_len=131072." (OpenAI answers that request
    # context_length_exceeded, param messages)
    EngineErrorRule("context_length_exceeded", ErrorType.INVALID_REQUEST, _CLIENT, _rx(
        r"maximum context length|longer than the maximum model length|cannot be greater than max_model_len|"
        r"max_(completion_)?tokens'? (or '?max_completion_tokens'? )?(is )?too large"), param=PROMPT),
    # vLLM and the router: "The model `m` does not exist."
    EngineErrorRule("model_not_found", ErrorType.INVALID_REQUEST, frozenset({404}),
                    _rx(r"model\b.*\b(does not exist|not found)"), param="model"),
    # FastAPI's own 404/405 for a path the engine does not serve: {"detail": "Not Found"}
    EngineErrorRule("unknown_url", ErrorType.INVALID_REQUEST, frozenset({404, 405}),
                    _rx(r"^(not found|method not allowed)$"), param=None,
                    message="The engine serving the model '{model}' has no endpoint {endpoint} (it answered "
                            "HTTP {status} {detail}); this model cannot serve requests of this batch's "
                            "endpoint."),
    # pydantic: "Input should be a valid integer", {'type': 'int_parsing', …}
    EngineErrorRule("invalid_type", ErrorType.INVALID_REQUEST, _BAD_REQUEST, _rx(
        r"input should be a valid|'type': '\w+_(parsing|type)'|invalid type")),
    EngineErrorRule("missing_required_parameter", ErrorType.INVALID_REQUEST, _BAD_REQUEST,
                    _rx(r"field required|'type': 'missing'|missing required")),
    EngineErrorRule("invalid_value", ErrorType.INVALID_REQUEST, _BAD_REQUEST),
    EngineErrorRule("rate_limit_exceeded", ErrorType.RATE_LIMIT, frozenset({429})),
    EngineErrorRule(None, ErrorType.INVALID_REQUEST, _CLIENT),
    EngineErrorRule("server_error", ErrorType.SERVER, range(500, 600)),
)
"""The one table from an engine's error (status, message) to OpenAI's ``type`` and ``code``; the
first matching row wins. Codes are OpenAI's (its API reference, "Error codes", and its batch error
lines); ``unknown_url`` is the router's own code for a path it does not serve. An error no row
matches (a status outside 4xx/5xx) becomes ``server_error``."""

MAX_MESSAGE_CHARS: Final = 2000
"""An engine's message is cut to this many characters (pydantic's messages quote the input, which
may be a whole prompt)."""

_FALLBACK = EngineErrorRule("server_error", ErrorType.SERVER, frozenset())
_PARAMETER_IN_MESSAGE = re.compile(r"\(parameter=([A-Za-z_][\w.\[\]]*)")
_PYDANTIC_LOC = re.compile(r"'loc': \('body', '([A-Za-z_]\w*)'")


def _engine_fields(body: Any) -> tuple[str, Any, Any, Any]:
    """``(message, type, param, code)`` of any error body an engine or a proxy writes: OpenAI's and
    recent vLLM's ``{"error": {…}}``, older vLLM's flat ``{"object": "error", "message", …}``,
    FastAPI's ``{"detail": str | list}``, llm-d-async's ``{"error": "text"}``, or anything else
    (its JSON text)."""
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict):
            body = inner
        elif isinstance(inner, str):
            return inner, None, None, None
        if isinstance(body.get("message"), str):
            return body["message"], body.get("type"), body.get("param"), body.get("code")
        detail = body.get("detail")
        if isinstance(detail, str):
            return detail, None, None, None
        if isinstance(detail, list):  # FastAPI's 422: [{"type", "loc", "msg", "input"}, …]
            return repr(detail), None, None, None
    return "" if body is None else str(body), None, None, None


def openai_error(status: int, body: Any, *, endpoint: str, model: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope ``{"error": {message, type, param, code}}`` for an error answer.

    ``status``: the HTTP status (4xx or 5xx; anything else is treated as a server error); ``body``:
    the answer's parsed JSON (any value); ``endpoint``: the request's path, e.g.
    ``/v1/chat/completions`` (names the prompt field of a ``context_length_exceeded`` error and an
    endpoint the engine lacks); ``model``: the request's model. An error already in OpenAI's words
    (``type`` in :data:`OPENAI_TYPES` and a string ``code``) is returned as it is; any other goes
    through :data:`ENGINE_ERRORS`. ``code`` is a string or null, never the integer status. Never
    raises.
    """
    message, type_, param, code = _engine_fields(body)
    if type_ in OPENAI_TYPES and isinstance(code, str) and code:
        return error_envelope(message, type_, param if isinstance(param, str) else None, code)
    rule = next((r for r in ENGINE_ERRORS if r.matches(status, message)), _FALLBACK)
    if rule.param == PROMPT:
        param = PROMPT_PARAM.get(endpoint, "input")
    elif rule.param == KEEP:
        if not isinstance(param, str) or not param:
            found = _PARAMETER_IN_MESSAGE.search(message) or _PYDANTIC_LOC.search(message)
            param = found.group(1) if found else None
    else:
        param = rule.param
    message = message[:MAX_MESSAGE_CHARS] or f"HTTP {status}"
    if rule.message is not None:
        message = rule.message.format(endpoint=endpoint, model=model or "", status=status, detail=message)
    return error_envelope(message, rule.type, param, rule.code)

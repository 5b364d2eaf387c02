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
"""

from __future__ import annotations

import enum
from typing import Any

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

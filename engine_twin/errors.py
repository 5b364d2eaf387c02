"""Errors of the engine simulator, each carrying vLLM's HTTP status and error ``type``.

    EngineSimError (500, InternalServerError)
    ├── BadRequestError (400)      invalid parameters, context length exceeded, empty messages
    ├── NotFoundError (404)        unknown model: "The model `X` does not exist. Valid aliases: A, B."
    │   └── InvalidJSONError (400) a body that is not JSON: type "Bad Request", param "body.0" (FastAPI's
    │                              request validation, as vLLM answers it)
    └── InjectedError (any)        a fault injected with --failure-rate or POST /sim/fault

One handler in ``server.py`` turns them into vLLM's envelope::

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}
"""

from __future__ import annotations

from typing import Any

from common.contracts.errors import ErrorType, error_envelope, vllm_type_for_status


class EngineSimError(Exception):
    status = 500
    type: str = ErrorType.VLLM_INTERNAL

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's error envelope for this error."""
        return error_envelope(self.message, self.type, self.param, self.status)


class BadRequestError(EngineSimError):
    status = 400
    type = ErrorType.VLLM_BAD_REQUEST


class InvalidJSONError(BadRequestError):
    """A body that does not parse; ``detail`` is the JSON parser's message (e.g. "Expecting value")."""

    type = ErrorType.VLLM_BAD_REQUEST_BODY

    def __init__(self, detail: str):
        super().__init__("1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.0', 'msg': 'JSON decode "
                         f"error', 'input': '<dict of 0 items>', 'ctx': {{'error': {detail!r}}}}}", "body.0")


class NotFoundError(EngineSimError):
    status = 404
    type = ErrorType.VLLM_NOT_FOUND


class InjectedError(EngineSimError):
    """A simulated failure with any status (429 → RateLimitError, 503 → ServiceUnavailableError)."""

    def __init__(self, status: int, message: str = "simulated failure"):
        super().__init__(message)
        self.status = status
        self.type = vllm_type_for_status(status) if status in (429, 503) else ErrorType.VLLM_INTERNAL

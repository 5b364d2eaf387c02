"""Errors of the gateway, each carrying its HTTP status and OpenAI ``type`` / ``code``.

::

    GatewayError                      500 api_error (never raised on purpose)
    ├── InvalidRequestError           400 invalid_request_error
    │   ├── UnsupportedMediaTypeError 415
    │   └── RequestTimeoutError       408
    ├── AuthenticationError           401 invalid_request_error / invalid_api_key
    ├── NotFoundError                 404 invalid_request_error
    ├── ConflictError                 409 invalid_request_error
    ├── PayloadTooLargeError          413 invalid_request_error
    ├── RateLimitError                429 tokens / token_limit_exceeded (with Retry-After)
    └── ServiceUnavailableError       503 server_error / service_unavailable (with Retry-After)

:func:`error_body` renders any of them as OpenAI's envelope
``{"error": {"message", "type", "param", "code"}}`` (:mod:`common.contracts.errors`);
``batch_gateway.app`` installs the handlers.
"""

from __future__ import annotations

from typing import Any

from common.contracts.errors import ErrorType, error_envelope


class GatewayError(Exception):
    """Root of the gateway's errors: ``status`` (HTTP), ``type`` and ``code`` (OpenAI), ``param``."""

    status = 500
    type: str = ErrorType.API
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}


class InvalidRequestError(GatewayError):
    """400: the request's arguments are wrong."""

    status = 400
    type = ErrorType.INVALID_REQUEST


class UnsupportedMediaTypeError(InvalidRequestError):
    """415: the body's Content-Type is not the one this endpoint takes."""

    status = 415


class RequestTimeoutError(InvalidRequestError):
    """408: the client stopped sending its body."""

    status = 408


class AuthenticationError(GatewayError):
    """401: no, a malformed, an unknown or a revoked API key."""

    status = 401
    type = ErrorType.INVALID_REQUEST
    code = "invalid_api_key"


class NotFoundError(GatewayError):
    """404: no such object for this tenant (another tenant's object answers the same)."""

    status = 404
    type = ErrorType.INVALID_REQUEST


class ConflictError(GatewayError):
    """409: e.g. an ``Idempotency-Key`` reused with different arguments."""

    status = 409
    type = ErrorType.INVALID_REQUEST


class PayloadTooLargeError(GatewayError):
    """413: an upload or body over its byte cap."""

    status = 413
    type = ErrorType.INVALID_REQUEST


class RateLimitError(GatewayError):
    """429: over a quota; carries ``Retry-After``."""

    status = 429
    type = ErrorType.TOKENS
    code = "token_limit_exceeded"


class ServiceUnavailableError(GatewayError):
    """503: a store the request needs (Postgres) cannot be reached; nothing was changed, the same
    request may be sent again after ``Retry-After`` seconds."""

    status = 503
    type = ErrorType.SERVER
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_seconds: int = 5):
        super().__init__(message, headers={"retry-after": str(retry_after_seconds)})


def error_body(error: GatewayError) -> dict[str, Any]:
    """OpenAI's error envelope of ``error`` as a dict."""
    return error_envelope(error.message, error.type, error.param, error.code)

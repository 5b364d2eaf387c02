"""Errors of the gateway, each carrying its HTTP status and OpenAI ``type`` / ``code``.

::

    GatewayError                      500 api_error (never raised on purpose)
    ├── InvalidRequestError           400 invalid_request_error
    │   ├── UnsupportedMediaTypeError 415
    │   └── RequestTimeoutError       408
    ├── AuthenticationError           401 invalid_request_error / invalid_api_key
    ├── NotFoundError                 404 invalid_request_error
    ├── ConflictError                 409 invalid_request_error (final)
    ├── PayloadTooLargeError          413 invalid_request_error
    ├── RateLimitError                429 tokens / token_limit_exceeded (final)
    ├── QueuedResponsesLimitError     429 rate_limit_error / rate_limit_exceeded (Retry-After)
    └── ServiceUnavailableError       503 server_error / service_unavailable (with Retry-After)

:func:`error_body` renders any of them as OpenAI's envelope
``{"error": {"message", "type", "param", "code"}}`` (:mod:`common.contracts.errors`);
``batch_gateway.app`` installs the handlers and sends :meth:`GatewayError.response_headers`.

**Final refusals.** The ``openai`` SDK retries 408, 409, 429 and 5xx answers twice by default
(``openai/_base_client.py`` ``_should_retry``), waiting ``Retry-After`` seconds when the server gives
one (up to 120 s). An error whose ``should_retry`` is False answers ``x-should-retry: false`` (the
SDK's own header, honoured before the status is looked at) and no ``Retry-After``, so the SDK raises
at once: a 409 (the same request meets the same state) and a quota refusal (tokens are freed only
when batches end, minutes to hours later) cannot be fixed by sending the request again.
"""

from __future__ import annotations

from typing import Any

from common.contracts.errors import ErrorType, error_envelope


class GatewayError(Exception):
    """Root of the gateway's errors: ``status`` (HTTP), ``type`` and ``code`` (OpenAI), ``param``."""

    status = 500
    type: str = ErrorType.API
    code: str | None = None
    should_retry: bool | None = None
    """False: the same request cannot succeed by being sent again soon (``x-should-retry: false``);
    None: leave it to the client's rules for the status."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def response_headers(self) -> dict[str, str]:
        """The headers of this error's answer: ``headers`` plus ``x-should-retry: false`` for a final
        refusal (which then never carries ``Retry-After``)."""
        if self.should_retry is False:
            return {**{k: v for k, v in self.headers.items() if k.lower() != "retry-after"},
                    "x-should-retry": "false"}
        return dict(self.headers)


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
    """409: the object's state refuses the request (a cancel of an ended batch, an
    ``Idempotency-Key`` reused with different arguments). Final: the same request meets the same
    state."""

    status = 409
    type = ErrorType.INVALID_REQUEST
    should_retry = False


class PayloadTooLargeError(GatewayError):
    """413: an upload or body over its byte cap."""

    status = 413
    type = ErrorType.INVALID_REQUEST


class RateLimitError(GatewayError):
    """429 ``token_limit_exceeded``: the tenant's enqueued tokens plus this batch would pass its
    quota. Final (``x-should-retry: false``, no ``Retry-After``): the quota frees only as the
    tenant's batches end, so the SDK's retries seconds later would meet the same refusal."""

    status = 429
    type = ErrorType.TOKENS
    code = "token_limit_exceeded"
    should_retry = False


class QueuedResponsesLimitError(GatewayError):
    """429 ``rate_limit_exceeded``: the tenant has as many background responses ``queued`` as its
    cap allows. Retryable after ``Retry-After`` seconds: queued responses start or expire within the
    queue's bound, often within seconds."""

    status = 429
    type = ErrorType.RATE_LIMIT
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_seconds: int = 10):
        super().__init__(message, headers={"retry-after": str(retry_after_seconds)})


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

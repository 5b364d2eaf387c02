"""Errors of flow control: one root, the drop reasons, and the exception a dropped request raises.

::

    FlowControlError                 root; never raised itself
    ├── ConfigError                  invalid flow-control config (also a ValueError); start-up only
    └── RequestDropped               the router will not run this request now: 429 (or 503) with a reason

``RequestDropped`` carries what the router answers (contracts/queue-and-headers.md): the HTTP status,
``Retry-After`` and ``x-llm-d-request-dropped-reason`` headers, and OpenAI's error envelope.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from common.contracts.errors import ErrorType, error_envelope

DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"


class DropReason(StrEnum):
    """Why a request was not run; the values are llm-d's ``x-llm-d-request-dropped-reason`` values
    and double as metric labels (STYLE.md 8)."""

    SATURATED = "rejected-saturated"
    """A band that does not queue (``ttl_s: 0``) met a saturated pool, or the controller stopped."""
    CAPACITY = "rejected-capacity"
    """The band's queued-request or queued-byte limit would be exceeded."""
    TTL_EXPIRED = "rejected-ttl-expired"
    """The request waited past its band's TTL or its own deadline."""
    QUOTA = "rejected-quota"
    """The tenant (fairness id) already has its per-band queued quota waiting."""
    EVICTED = "evicted"
    """The request was in flight and was chosen to make room for a higher band."""
    CONTEXT_CANCELLED = "rejected-context-cancelled"
    """The client went away while the request waited."""


class FlowControlError(Exception):
    """Root of every error raised by ``router.flow_control``."""


class ConfigError(FlowControlError, ValueError):
    """The flow-control configuration is invalid; the message names the field at fault."""


class RequestDropped(FlowControlError):
    """The request is not run now.

    Attributes:
        reason: the :class:`DropReason`.
        status: HTTP status, 429, or 503 when the pool has no engine at all (contract).
        retry_after_s: seconds the caller should wait before retrying (≥ 0; how each reason's value
            is chosen is in ``router/flow_control/core.py``, ``retry_after_for``).
        message: human-readable explanation (names the band, never the tenant).
    """

    def __init__(self, reason: DropReason, message: str, *, retry_after_s: float, status: int = 429) -> None:
        super().__init__(message)
        self.reason = DropReason(reason)
        self.status = status
        self.retry_after_s = max(0.0, float(retry_after_s))
        self.message = message

    def __repr__(self) -> str:
        return f"RequestDropped({self.reason.value!r}, status={self.status}, retry_after_s={self.retry_after_s})"

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` as HTTP wants it: whole seconds, rounded up, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))

    def headers(self) -> dict[str, str]:
        """The response headers: ``Retry-After`` and ``x-llm-d-request-dropped-reason``."""
        return {"Retry-After": self.retry_after_header, DROPPED_REASON_HEADER: self.reason.value}

    @property
    def error_type(self) -> ErrorType:
        """The envelope's ``type``, as vLLM names it for the status."""
        return ErrorType.VLLM_SERVICE_UNAVAILABLE if self.status == 503 else ErrorType.VLLM_RATE_LIMIT

    def body(self) -> dict[str, Any]:
        """OpenAI's error envelope; ``type`` as vLLM names it for the status, ``code`` the reason::

        {"error": {"message": "...", "type": "RateLimitError", "param": null, "code": "rejected-capacity"}}
        """
        return error_envelope(self.message, self.error_type, code=self.reason.value)

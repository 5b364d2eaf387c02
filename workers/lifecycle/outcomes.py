"""How a processor's result changes its request row (pure: a result in, a change out).

:func:`outcome_of` maps a :class:`~common.contracts.queue.ResultMessage` to a
:class:`RequestChange`, the columns :func:`batch_gateway.store.queries.record_outcome` writes;
:func:`usage_of` reads the token counts of an upstream body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from batch_gateway.store.states import RequestState
from common.contracts.queue import ErrorCode, ResultMessage
from workers.output import json_body

RETRYABLE = {ErrorCode.GATE_DROPPED, ErrorCode.GATE_ERROR, ErrorCode.INFERENCE_ERROR}
"""Result codes after which the request is fed again (up to ``max_attempts``)."""


class Usage(NamedTuple):
    """Token counts of one response (tokens; zero when the body gives none)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RequestChange:
    """A request row's new ``state`` and, for a terminal state, what it records. ``pending`` hands
    the request back to the feeder."""

    state: RequestState
    status_code: int | None = None
    request_id: str | None = None
    response_body: bytes | None = None
    error_code: str | None = None
    error_message: str | None = None
    usage: Usage = Usage()

    def columns(self) -> dict[str, Any]:
        """Keyword arguments of :func:`batch_gateway.store.queries.record_outcome`."""
        return {"state": self.state, "status_code": self.status_code, "request_id": self.request_id,
                "response_body": self.response_body, "error_code": self.error_code,
                "error_message": self.error_message, **self.usage._asdict()}


HANDED_BACK = RequestChange(RequestState.PENDING)
"""A retryable failure or a lost message (lapsed lease, message gone): fed again."""
CANCELLED = RequestChange(RequestState.CANCELLED, error_code="batch_cancelled")
EXPIRED = RequestChange(RequestState.EXPIRED, error_code="batch_expired")
TIMED_OUT = RequestChange(RequestState.FAILED, error_code="request_timeout")


def usage_of(body: bytes) -> Usage:
    """The ``usage`` of a Chat Completions or Responses body (``prompt_tokens`` / ``input_tokens``,
    their ``cached_tokens``, ``completion_tokens`` / ``output_tokens``, their ``reasoning_tokens``);
    all zero when the body is not JSON or has no usage object."""
    try:
        usage = orjson.loads(body).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return Usage()
    if not isinstance(usage, dict):
        return Usage()
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    out_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    return Usage(
        prompt_tokens=int(prompt),
        cached_tokens=int(details.get("cached_tokens", 0) or 0) if isinstance(details, dict) else 0,
        completion_tokens=int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0),
        reasoning_tokens=int(out_details.get("reasoning_tokens", 0) or 0) if isinstance(out_details, dict) else 0,
    )


RESPONSE_TOO_LARGE = "response_too_large"
"""Error code of a request whose answer was over the response-size limit (docs/limits.md)."""


def too_large(size: int, limit: int) -> RequestChange:
    """The change for an answer of ``size`` bytes over ``limit``: ``failed`` with
    ``response_too_large`` and no body (nothing of it is kept)."""
    return RequestChange(RequestState.FAILED, error_code=RESPONSE_TOO_LARGE,
                         error_message=f"The response to this request was {size:,} bytes, over the limit of "
                                       f"{limit:,} bytes per request; ask for fewer choices ('n') or fewer "
                                       "tokens ('max_tokens').")


def outcome_of(result: ResultMessage, attempt: int, max_attempts: int,
               max_response_bytes: int | None = None) -> RequestChange:
    """How ``result`` (of delivery ``attempt``, 1-based) changes its request row.

    An HTTP answer → ``succeeded`` (2xx, with its usage) or ``failed`` (its body kept, as JSON:
    the engine's own words, put in OpenAI's when the file is written); ``request_id`` is the
    engine's id of the answer, the body's ``id`` when a string, else None (the result's ``id`` is
    the queue's, which means nothing to the user). An answer longer than
    ``max_response_bytes`` (UTF-8 bytes; None: no limit) → ``failed`` / ``response_too_large``,
    without its body (:func:`too_large`). No answer: past the
    deadline → ``expired`` / ``batch_expired``; cancelled → ``cancelled`` / ``batch_cancelled``; a
    retryable code before ``max_attempts`` → back to ``pending``; else ``failed`` with
    ``request_timeout`` (retryable codes, and ``INFERENCE_TIMEOUT``: the attempt's timeout passed,
    never re-run) or ``batch_failed`` and the result's message.
    """
    if not result.error_code and result.status_code:
        if max_response_bytes is not None and len(result.payload) > max_response_bytes // 4:
            size = len(result.payload.encode("utf-8", "surrogatepass"))  # only a long one is measured
            if size > max_response_bytes:
                return too_large(size, max_response_bytes)
        body = json_body(result.payload, result.status_code)
        ok = 200 <= result.status_code < 300
        try:
            request_id = orjson.loads(body).get("id")
        except (orjson.JSONDecodeError, AttributeError):
            request_id = None
        return RequestChange(RequestState.SUCCEEDED if ok else RequestState.FAILED,
                             status_code=result.status_code,
                             request_id=request_id if isinstance(request_id, str) and request_id else None,
                             response_body=body, usage=usage_of(body) if ok else Usage())
    if result.error_code == ErrorCode.DEADLINE_EXCEEDED:
        return EXPIRED
    if result.error_code == ErrorCode.CANCELLED:
        return CANCELLED
    if result.error_code in RETRYABLE and attempt < max_attempts:
        return HANDED_BACK
    timed_out = result.error_code in RETRYABLE or result.error_code == ErrorCode.INFERENCE_TIMEOUT
    return RequestChange(RequestState.FAILED, error_code="request_timeout" if timed_out else "batch_failed",
                         error_message=result.error_message or None)

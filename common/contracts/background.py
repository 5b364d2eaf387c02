"""Background responses on the async lane: the contract between the gateway (which stores and
publishes them) and the workers (which collect their results).

A background response (OpenAI's ``POST /v1/responses`` with ``background: true``) is one request
message on the ``async`` lane (:data:`ASYNC_LANE`) of the pool, its ``metadata`` carrying the tenant
(the fairness id), the objective ``async`` and the response id twice: as ``response_id`` and as
``batch_id``, the key the processor's cancel marker is read by (:func:`~common.contracts.queue.
cancel_marker_key`), so a cancel drops the message while it is queued or held, and aborts it in
flight. Its ``result_queue_name`` is :func:`response_result_stream` of the pool, read by the
consumer group :data:`RESPONSE_COLLECTOR_GROUP`.

The router gets a stateless ``POST /v1/responses`` (:func:`engine_body`): the whole conversation as
``input`` (OpenAI's chaining rule, :func:`common.contracts.responses.conversation_input`), ``store: false``, no ``background``,
``stream`` or ``previous_response_id``. Its answer becomes the stored response by
:func:`result_outcome`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from common.contracts.queue import ErrorCode, RequestMessage, ResultMessage

ASYNC_LANE = "async"
"""The lane background responses ride (priority 10: after interactive, before batch)."""
RESPONSES_ENDPOINT = "/v1/responses"
RESPONSE_COLLECTOR_GROUP = "response-collectors"
"""Consumer group of the workers on :func:`response_result_stream`."""

ENGINE_DROPPED_FIELDS = ("background", "previous_response_id", "stream", "stream_options", "store")
"""Create fields the gateway keeps to itself: the router gets a stateless, non-streamed request."""


def response_result_stream(pool: str) -> str:
    """Result stream of the pool's background responses: ``backfill:results:responses:{pool}``."""
    return f"backfill:results:responses:{pool}"


def engine_body(request: dict[str, Any], conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The body sent to the router: the create ``request`` less :data:`ENGINE_DROPPED_FIELDS`,
    with ``input`` = ``conversation`` and ``store: false``."""
    body = {k: v for k, v in request.items() if k not in ENGINE_DROPPED_FIELDS}
    body["input"] = conversation
    body["store"] = False
    return body


def request_message(response_id: str, tenant_id: str, *, created: int, deadline: int, body: dict[str, Any],
                    pool: str) -> RequestMessage:
    """The async-lane message of a background response: ``created`` and ``deadline`` in Unix
    seconds (not dispatched after ``deadline``), ``body`` from :func:`engine_body`, results to
    :func:`response_result_stream` of ``pool`` (see the module docstring for ``metadata``)."""
    return RequestMessage(id=response_id, created=created, deadline=deadline, payload=body,
                          endpoint=RESPONSES_ENDPOINT, result_queue_name=response_result_stream(pool),
                          metadata={"tenant": tenant_id, "objective": ASYNC_LANE, "response_id": response_id,
                                    "batch_id": response_id})


@dataclass(frozen=True)
class ResultOutcome:
    """What a result makes of a background response: its ``status`` (``completed``,
    ``incomplete``, ``failed`` or ``cancelled``) and OpenAI's ``output``, ``usage``, ``error``
    (``{"code", "message"}``) and ``incomplete_details``."""

    status: str
    output: list[dict[str, Any]] | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    incomplete_details: dict[str, Any] | None = None


EXPIRED_MESSAGE = "No spare capacity freed up to run this background response before it expired; create it again."
"""Message of a background response that expired while queued (``failed``, code
``rate_limit_exceeded``: OpenAI's flex tier answers the same situation, no capacity in time, with
a 429)."""


def expired_error() -> dict[str, str]:
    """The ``error`` of a background response that expired while queued."""
    return {"code": "rate_limit_exceeded", "message": EXPIRED_MESSAGE}


def _upstream_error(result: ResultMessage) -> dict[str, str]:
    """``{"code", "message"}`` from the router's error envelope (any shape tolerated)."""
    message, code = f"The model server answered HTTP {result.status_code}.", None
    try:
        body = orjson.loads(result.payload)
    except orjson.JSONDecodeError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or message)
        code = error.get("code")
    if not isinstance(code, str) or not code:
        code = "server_error" if result.status_code >= 500 or result.status_code == 429 else "invalid_prompt"
    return {"code": code, "message": message}


def result_outcome(result: ResultMessage) -> ResultOutcome:
    """The outcome a processor result gives its background response.

    - a 2xx answer with a response object: its ``status`` when ``incomplete``, else ``completed``,
      with its ``output``, ``usage`` and ``incomplete_details``;
    - ``CANCELLED``: ``cancelled``; ``DEADLINE_EXCEEDED``: ``failed`` with :func:`expired_error`;
    - any other error code, or a 2xx that is not a response object: ``failed``, code
      ``server_error``;
    - a non-2xx HTTP answer: ``failed`` with the router's error message and code
      (:func:`_upstream_error`).
    """
    if result.error_code == ErrorCode.CANCELLED:
        return ResultOutcome("cancelled")
    if result.error_code == ErrorCode.DEADLINE_EXCEEDED:
        return ResultOutcome("failed", error=expired_error())
    if result.error_code:
        return ResultOutcome("failed", error={"code": "server_error",
                                              "message": result.error_message or result.error_code})
    if not result.ok:
        return ResultOutcome("failed", error=_upstream_error(result))
    try:
        body = orjson.loads(result.payload)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict) or body.get("object") != "response" or not isinstance(body.get("output"), list):
        return ResultOutcome("failed", error={"code": "server_error",
                                              "message": "The model server's answer was not a response object."})
    status = "incomplete" if body.get("status") == "incomplete" else "completed"
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
    details = body.get("incomplete_details") if isinstance(body.get("incomplete_details"), dict) else None
    return ResultOutcome(status, output=body["output"], usage=usage, incomplete_details=details)

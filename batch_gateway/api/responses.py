"""``/v1/responses``: background responses, as OpenAI's Responses API with ``background: true``.

==========================================  =======================================================
``POST /v1/responses``                      ``background: true`` only: stored ``queued`` and put on
                                            the async lane (spare capacity, after interactive,
                                            before batch); answers the Response object at once
``GET /v1/responses/{id}``                  the Response object; with ``stream=true`` its events
                                            (SSE) after ``starting_after`` (a sequence number),
                                            following it live until it ends
``DELETE /v1/responses/{id}``               forgets it (an open one is cancelled first)
``POST /v1/responses/{id}/cancel``          a ``queued`` or ``in_progress`` one becomes
                                            ``cancelled`` (its message dropped, its run aborted, a
                                            late result discarded); a cancelled one answers as it
                                            is; one that ended otherwise is 400
==========================================  =======================================================

``stream: true`` at create answers the events (SSE) instead of the object, from
``response.created`` (``queued``) on, as OpenAI streams a background response.

Refusals (OpenAI's envelope): 400 without ``background: true`` (synchronous responses are the
router's), ``store: false`` (a background response is stored), ``conversation``, a bad ``model``,
``stream`` or ``input`` (a string or input items: :func:`~common.contracts.responses.input_problem`
names the param, e.g. ``input[0].content[0].text``), or an unknown ``previous_response_id`` (code
``previous_response_not_found``, as OpenAI); 404 for another tenant's or an unknown id; 429
``rate_limit_exceeded`` when the tenant has its cap of responses ``queued``
(:class:`~batch_gateway.errors.QueuedResponsesLimitError`).

The row commits before the message is published; a publish that fails is logged and left to the
workers, which publish rows whose publish was never recorded (``workers.responses``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from batch_gateway.api.batches import json_body
from batch_gateway.deps import SessionDep, SettingsDep, TenantDep
from batch_gateway.errors import InvalidRequestError, NotFoundError, QueuedResponsesLimitError
from batch_gateway.response_objects import response_events, response_object
from batch_gateway.store.models import BackgroundResponse
from batch_gateway.store.queries import responses as response_queries
from batch_gateway.store.response_queue import publish_responses
from batch_gateway.store.states import OPEN_RESPONSE_STATUSES, ResponseStatus
from common.contracts.responses import (
    PREVIOUS_NOT_FOUND_CODE,
    conversation_input,
    deleted_object,
    input_items,
    input_problem,
    new_response_id,
    not_found_json,
    previous_not_found_message,
)
from common.json_types import json_type_name
from common.logging import tenant_fields

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/responses", tags=["responses"])

CHAINABLE_STATUSES = (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE)
"""Statuses of a response another may name as ``previous_response_id``."""
MAX_MODEL_CHARS = 256
"""Longest ``model`` stored (the column's width)."""
STREAM_POLL_SECONDS = 0.5
"""How often a live stream re-reads a response that has not ended."""


def _bad(message: str, param: str | None, code: str | None = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def _has_nul(value: Any) -> bool:
    """Whether a NUL character is in any string (key or value) of a JSON value."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(item) for item in value)
    return False


def check_create(body: dict[str, Any]) -> None:
    """Check a create body's own fields (see the module docstring); raises :class:`InvalidRequestError`."""
    if body.get("background") is not True:
        raise _bad("This endpoint serves background responses only: set 'background' to true (synchronous "
                   "responses are served by the router).", "background", "unsupported_value")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _bad(f"Invalid type for 'stream': expected a boolean, but got {json_type_name(body['stream'])} instead.",
                   "stream", "invalid_type")
    if body.get("store") not in (None, True):
        raise _bad("Background responses must be stored: 'store' cannot be false with 'background'.", "store")
    if body.get("conversation") is not None:
        raise _bad("The Conversations API is not supported; use previous_response_id.", "conversation",
                   "unsupported_value")
    model = body.get("model")
    if isinstance(model, str) and len(model) > MAX_MODEL_CHARS:
        raise _bad(f"Invalid 'model': string too long. Expected a string with maximum length {MAX_MODEL_CHARS}, "
                   f"but got a string with length {len(model)} instead.", "model", "string_above_max_length")
    if not isinstance(model, str) or not model:
        raise _bad("Missing required parameter: 'model'." if model is None else
                   f"Invalid type for 'model': expected a string, but got {json_type_name(model)} instead.",
                   "model", "missing_required_parameter" if model is None else "invalid_type")
    if "input" not in body:
        raise _bad("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    if (problem := input_problem(body["input"])) is not None:
        raise _bad(*problem)
    if _has_nul(body):  # Postgres JSON cannot hold NUL: refused, never a 500
        raise _bad("The request contains a NUL character (\\u0000), which is not supported.", None)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _bad("Invalid type for 'previous_response_id': expected a non-empty string.", "previous_response_id",
                   "invalid_type")


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(orjson.loads(not_found_json(response_id[:100]))["error"]["message"])


@router.post("", response_model=None)
async def create_response(request: Request, tenant: TenantDep, session: SessionDep,
                          settings: SettingsDep) -> dict | StreamingResponse:
    """Create a background response in ``queued`` and publish it on the async lane; answer its
    Response object, or with ``stream: true`` its events (SSE) from ``response.created`` on,
    followed live until it ends (as ``GET …?stream=true``: a client that drops resumes there with
    ``starting_after``)."""
    body = await json_body(request, settings.max_json_body_bytes)
    check_create(body)
    previous_id = body.get("previous_response_id")

    def create() -> BackgroundResponse:
        conversation = input_items(body["input"])
        if previous_id is not None:
            previous = response_queries.get_response(session, tenant.id, previous_id)
            if previous is None or previous.status not in CHAINABLE_STATUSES:
                raise _bad(previous_not_found_message(previous_id) if previous is None else
                           f"Previous response with id '{previous_id}' has not finished (status "
                           f"'{previous.status}').", "previous_response_id",
                           PREVIOUS_NOT_FOUND_CODE if previous is None else "invalid_value")
            conversation = conversation_input(previous.input, previous.output or [], body["input"])
        limit = (response_queries.lock_tenant_response_limit(session, tenant.id)
                 or settings.max_queued_background_responses)
        if response_queries.queued_responses(session, tenant.id) >= limit:
            raise QueuedResponsesLimitError(
                f"Queued background response limit reached for organization {tenant.name}. Limit: {limit:,} queued "
                "responses. Please try again once some have started.")
        row = response_queries.insert_response(
            session, response_id=new_response_id(), tenant_id=tenant.id, model=body["model"],
            previous_response_id=previous_id, request=body, input=conversation,
            queue_seconds=settings.background_queue_seconds)
        session.commit()
        return row

    row = await run_in_threadpool(create)
    request.app.state.metrics.responses_created.inc()
    log.info("background response created", extra={"action": "response_created", "response_id": row.id,
                                                    **tenant_fields(tenant.id, tenant.name)})
    await run_in_threadpool(_publish, request, session, row)
    if body.get("stream") is True:
        session.close()  # the stream reads with sessions of its own
        return StreamingResponse(_event_stream(request, tenant.id, row.id, None), media_type="text/event-stream")
    return response_object(row)


def _publish(request: Request, session: Session, row: BackgroundResponse) -> None:
    """Publish ``row`` and record its entry id; a failure is logged (the workers publish it later)."""
    state = request.app.state
    try:
        entry_ids = publish_responses(state.response_lanes, [row], state.settings.queue_pool)
        response_queries.record_published(session, row.id, entry_ids[0])
        session.commit()
    except Exception as exc:  # BackendError, a database error: the row is committed, the workers retry
        session.rollback()
        log.warning("background response not published", extra={"action": "response_publish_failed",
                                                                 "response_id": row.id, "error": str(exc)[:200]})


@router.get("/{response_id}", response_model=None)
async def retrieve_response(response_id: str, request: Request, tenant: TenantDep, session: SessionDep,
                            stream: bool = False,
                            starting_after: Annotated[int | None, Query(ge=-1)] = None) -> Any:
    """The Response object; with ``stream=true`` its events after ``starting_after`` as SSE."""
    row = await run_in_threadpool(response_queries.get_response, session, tenant.id, response_id)
    if row is None:
        raise _not_found(response_id)
    if not stream:
        return response_object(row)
    session.close()  # the stream reads with sessions of its own
    return StreamingResponse(_event_stream(request, tenant.id, response_id, starting_after),
                             media_type="text/event-stream")


async def _event_stream(request: Request, tenant_id: str, response_id: str,
                        starting_after: int | None) -> AsyncIterator[bytes]:
    """SSE of the response's events after ``starting_after``, re-reading it every
    :data:`STREAM_POLL_SECONDS` until it has ended (or the client left)."""
    sent = -1 if starting_after is None else starting_after

    def read() -> BackgroundResponse | None:
        with request.app.state.sessionmaker() as own:
            return response_queries.get_response(own, tenant_id, response_id)

    while True:
        row = await run_in_threadpool(read)
        if row is None:
            return
        for event in response_events(row):
            if event["sequence_number"] > sent:
                sent = event["sequence_number"]
                yield b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
        if row.status not in OPEN_RESPONSE_STATUSES or await request.is_disconnected():
            return
        await asyncio.sleep(STREAM_POLL_SECONDS)


def _stop(request: Request, response_id: str) -> None:
    """Set the cancel marker: processors drop the response's message or abort its attempt."""
    try:
        request.app.state.response_lanes.mark_cancelled(response_id,
                                                        request.app.state.settings.background_queue_seconds + 3600)
    except Exception as exc:  # the result of a run that was not stopped is discarded anyway
        log.warning("cancel marker not set", extra={"action": "response_cancel_marker_failed",
                                                    "response_id": response_id, "error": str(exc)[:200]})


@router.delete("/{response_id}")
def delete_response(response_id: str, request: Request, tenant: TenantDep, session: SessionDep) -> dict:
    """Delete a background response: ``{"id", "object": "response.deleted", "deleted": true}``; one
    still open is stopped as by a cancel."""
    found = response_queries.delete_response(session, tenant.id, response_id)
    if found is None:
        raise _not_found(response_id)
    session.commit()
    if found in OPEN_RESPONSE_STATUSES:
        _stop(request, response_id)
    return deleted_object(response_id)


@router.post("/{response_id}/cancel")
def cancel_response(response_id: str, request: Request, tenant: TenantDep, session: SessionDep) -> dict:
    """Cancel a background response (module docstring); the processors are told through the cancel
    marker, so its message is dropped and an attempt in flight aborted."""
    outcome = response_queries.cancel_response(session, tenant.id, response_id)
    if outcome is None:
        raise _not_found(response_id)
    session.commit()
    if outcome.found in OPEN_RESPONSE_STATUSES:
        _stop(request, response_id)
        log.info("background response cancelled", extra={"action": "response_cancelled", "response_id": response_id,
                                                         **tenant_fields(tenant.id, tenant.name)})
    elif outcome.found != ResponseStatus.CANCELLED:
        raise _bad(f"Cannot cancel a response with status '{outcome.found}'.", None, None)
    return response_object(outcome.response)

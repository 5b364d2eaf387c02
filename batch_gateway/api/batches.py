"""``/v1/batches``: create (idempotent with ``Idempotency-Key``), retrieve, list, cancel — as OpenAI.

Validation of the input file is asynchronous: create answers ``validating`` and the worker's
validate task moves the batch on. ``POST /v1/batches`` itself answers 400 only for its own bad
arguments and 429 ``token_limit_exceeded`` when the tenant's enqueued tokens plus this batch's
reservation (from its file size) would pass the quota.

Create and cancel never wait on the broker: the change and its outbox row commit together, the
answer goes out, and the outbox thread (or later the workers' relay) sends the task
(docs/reliability.md). A database that cannot be reached answers 503 with ``Retry-After``
(``batch_gateway.app``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Annotated

import orjson
from fastapi import APIRouter, Header, Query, Request
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from batch_gateway.api import list_page
from batch_gateway.deps import SessionDep, SettingsDep, TenantDep
from batch_gateway.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    UnsupportedMediaTypeError,
)
from batch_gateway.schemas import CreateBatch, batch_object, window_seconds
from batch_gateway.store import queries
from batch_gateway.store.quota import token_limit_message
from common.logging import tenant_fields
from common.tracing import current_traceparent

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/batches", tags=["batches"])


async def json_body(request: Request, max_bytes: int) -> dict:
    """The request's JSON object body (at most ``max_bytes``).

    Raises 415 for another Content-Type, 413 when too large, 400 when not a JSON object (invalid
    UTF-8, NaN, huge integers, deep nesting included).
    """
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaTypeError("This endpoint expects an application/json body.")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise PayloadTooLargeError(f"The request body is larger than {max_bytes} bytes.")
    except ClientDisconnect:  # nobody reads the answer; a clean 4xx keeps it out of the 500 path
        raise InvalidRequestError("The client closed the connection before the body was complete.") from None
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequestError(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
            "using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return value


def reserved_tokens(file_bytes: int) -> int:
    """Tokens a new batch holds against the quota until validated: ``ceil(file bytes / 4)``, an
    upper bound of validation's estimate (prompt bytes / 4, OpenAI's ~4 characters per token),
    since the prompts are part of the file."""
    return -(-file_bytes // 4)


def _validation_error(exc: ValidationError) -> InvalidRequestError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = f"Missing required parameter: '{param}'."
    elif first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    return InvalidRequestError(message, param=param)


def _request_hash(args: CreateBatch) -> str:
    canonical = orjson.dumps(args.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()


@router.post("")
async def create_batch(request: Request, tenant: TenantDep, session: SessionDep,
                       settings: SettingsDep,
                       idempotency_key: Annotated[str | None, Header(max_length=256)] = None) -> dict:
    """Create a batch in ``validating``. With ``Idempotency-Key``: the same key and arguments give
    back the same batch; the same key with other arguments is 409."""
    raw = await json_body(request, settings.max_json_body_bytes)
    try:
        args = CreateBatch.model_validate(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request_hash = _request_hash(args)

    def create() -> dict:
        if idempotency_key is not None:
            existing = queries.get_batch_by_idempotency_key(session, tenant.id, idempotency_key)
            if existing is not None:
                return _replay(existing, request_hash)
        source = queries.get_file(session, tenant.id, args.input_file_id)
        if source is None:
            raise InvalidRequestError(f"No such File object: {args.input_file_id}", param="input_file_id")
        if source.purpose != "batch":
            raise InvalidRequestError(
                f"File {source.id} has purpose '{source.purpose}'; a batch input file must have purpose 'batch'.",
                param="input_file_id",
            )
        locked = queries.lock_tenant(session, tenant.id)
        limit = locked.enqueued_token_limit or settings.default_enqueued_token_limit
        reserved = reserved_tokens(source.bytes)
        if queries.enqueued_tokens(session, tenant.id) + reserved > limit:
            raise RateLimitError(token_limit_message(tenant.name, limit))
        try:
            with session.begin_nested():
                batch = queries.insert_batch(
                    session, tenant_id=tenant.id, endpoint=args.endpoint,
                    input_file_id=source.id, completion_window=args.completion_window,
                    window_seconds=window_seconds(args.completion_window), metadata=args.metadata,
                    output_expires_after=(args.output_expires_after.model_dump()
                                          if args.output_expires_after else None),
                    idempotency_key=idempotency_key, request_hash=request_hash,
                    reserved_tokens=reserved, traceparent=current_traceparent(),
                )
        except IntegrityError:  # a concurrent create with the same Idempotency-Key won
            session.rollback()
            assert idempotency_key is not None  # only a keyed create can collide
            existing = queries.get_batch_by_idempotency_key(session, tenant.id, idempotency_key)
            return _replay(existing, request_hash)
        session.commit()
        log.info("batch created", extra={"action": "batch_created", "batch_id": batch.id,
                                         **tenant_fields(tenant.id, tenant.name)})
        request.app.state.outbox.wake()  # the broker is told off the request (store/outbox.py)
        return batch_object(batch)

    return await run_in_threadpool(create)


def _replay(existing, request_hash: str) -> dict:
    if existing.request_hash != request_hash:
        raise ConflictError(
            "This Idempotency-Key was already used with different request arguments.",
            code="idempotency_key_reused",
        )
    return batch_object(existing)


def _not_found(batch_id: str) -> NotFoundError:
    return NotFoundError(f"No such Batch object: {batch_id[:100]}", param="batch_id")


@router.get("")
def list_batches(tenant: TenantDep, session: SessionDep,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20,
                 after: Annotated[str | None, Query(max_length=128)] = None) -> dict:
    """The caller's batches, newest first (``after`` cursor, ``limit`` 1..100)."""
    page = queries.list_batches(session, tenant.id, limit=limit, after=after)
    return list_page(page, after, "Batch", batch_object)


@router.get("/{batch_id}")
def retrieve_batch(batch_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    """The Batch object; 404 when missing or another tenant's."""
    row = queries.get_batch(session, tenant.id, batch_id)
    if row is None:
        raise _not_found(batch_id)
    return batch_object(row)


@router.post("/{batch_id}/cancel")
def cancel_batch(batch_id: str, request: Request, tenant: TenantDep, session: SessionDep) -> dict:
    """Cancel by one rule (:data:`~batch_gateway.store.queries.batches.CANCEL_RULE`): a batch that
    has not ended becomes ``cancelling`` (or ``cancelled`` at once when nothing ran) and a cancel of
    a ``cancelling`` batch returns it unchanged, both 200 with the Batch; a batch that has ended
    (``completed``, ``failed``, ``expired``, ``cancelled``) answers 409 ``Cannot cancel a batch with
    status '…'.`` with ``x-should-retry: false`` and is not changed; 404 when missing or another
    tenant's."""
    outcome = queries.request_cancel(session, tenant.id, batch_id)
    if outcome is None:
        raise _not_found(batch_id)
    session.commit()
    if outcome.refusal is not None:
        raise ConflictError(outcome.refusal)
    request.app.state.outbox.wake()  # the cancel task goes out now, off the request
    log.info("batch cancel", extra={"action": "batch_cancel", "batch_id": batch_id,
                                    **tenant_fields(tenant.id, tenant.name), "status": outcome.batch.status})
    return batch_object(outcome.batch)

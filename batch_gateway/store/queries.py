"""Every query of the gateway and the workers, in one named place.

Each function takes the session and, where rows belong to a tenant, the tenant id explicitly. None
commits: the caller owns the transaction. Each status change is one compare-and-set UPDATE
(:func:`transition`) that also writes its event row, so a change and its outbox entry commit
together; time comes from the database clock.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

from sqlalchemy import Select, and_, case, func, or_, select, text, tuple_, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from batch_gateway.store.models import (
    ACTIVE_BATCH_STATUSES,
    EPOCH_NOW,
    ApiKey,
    Batch,
    BatchRequest,
    Event,
    File,
    Tenant,
)

KEY_PREFIX = "sk-bf-"

WEBHOOK_EVENTS = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")
"""Events sent to a tenant's webhook (OpenAI's batch event names)."""

VALIDATE_BATCH_TASK = "backfill.validate_batch"
CANCEL_BATCH_TASK = "backfill.cancel_batch"
"""Celery task telling the processors to drop a cancelled batch's queued messages at once."""
"""Celery task name of batch validation (``workers.tasks``); the outbox carries it."""


def new_id(prefix: str) -> str:
    """A new object id: ``prefix`` + 24 random hex characters (96 bits), e.g. ``batch_9f…``."""
    return prefix + secrets.token_hex(12)


def can_exist(object_id: str) -> bool:
    """Whether ``object_id`` could name a stored object. PostgreSQL text cannot hold NUL, so an id
    with one names nothing (and must not reach a query, which would fail with a 500)."""
    return "\x00" not in object_id


def hash_key(key: str) -> str:
    """SHA-256 hex of an API key: keys carry 256 random bits, so a fast hash is the standard
    choice (as for GitHub tokens); the plain key is never stored."""
    return hashlib.sha256(key.encode()).hexdigest()


# --- tenants and keys -------------------------------------------------------------------------


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    """The tenant owning the unrevoked key ``key``, or None."""
    return session.execute(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    ).scalar_one_or_none()


def ensure_tenant(session: Session, name: str) -> Tenant:
    """The tenant called ``name``, created if missing (safe under concurrent calls)."""
    session.execute(
        pg_insert(Tenant).values(id=new_id("tenant_"), name=name).on_conflict_do_nothing(
            index_elements=[Tenant.name]
        )
    )
    return session.execute(select(Tenant).where(Tenant.name == name)).scalar_one()


def add_api_key(session: Session, tenant_name: str, key: str | None = None) -> str:
    """Register ``key`` (or a new random one) for tenant ``tenant_name``; returns the key.

    Adding a key that already exists for the same tenant is a no-op; for another tenant it raises
    ``ValueError``.
    """
    tenant = ensure_tenant(session, tenant_name)
    key = key or KEY_PREFIX + secrets.token_urlsafe(32)
    session.execute(
        pg_insert(ApiKey)
        .values(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:12])
        .on_conflict_do_nothing(index_elements=[ApiKey.key_hash])
    )
    owner = session.execute(select(ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(key))).scalar_one()
    if owner != tenant.id:
        raise ValueError("that key already belongs to another tenant")
    return key


def list_api_keys(session: Session, tenant_name: str | None = None) -> list:
    """Rows ``(tenant name, key prefix, created_at, revoked_at)``, oldest first."""
    stmt = (select(Tenant.name, ApiKey.prefix, ApiKey.created_at, ApiKey.revoked_at)
            .join(Tenant, Tenant.id == ApiKey.tenant_id).order_by(ApiKey.id))
    if tenant_name is not None:
        stmt = stmt.where(Tenant.name == tenant_name)
    return list(session.execute(stmt).all())


def revoke_api_key(session: Session, key: str) -> bool:
    """Revoke ``key``; returns whether an active key was revoked."""
    result = session.execute(
        update(ApiKey)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
        .values(revoked_at=EPOCH_NOW)
    )
    return result.rowcount > 0


# --- files ------------------------------------------------------------------------------------


def insert_file(session: Session, *, file_id: str, tenant_id: str, size: int, filename: str,
                purpose: str, storage_key: str, sha256: str | None,
                expires_after_seconds: int | None) -> File:
    """Insert a file row; ``expires_at`` = the database's now + ``expires_after_seconds``."""
    expires = None if expires_after_seconds is None else text(
        f"extract(epoch from now())::bigint + {int(expires_after_seconds)}"
    )
    return session.execute(
        pg_insert(File)
        .values(id=file_id, tenant_id=tenant_id, bytes=size, filename=filename, purpose=purpose,
                storage_key=storage_key, sha256=sha256, expires_at=expires)
        .returning(File)
    ).scalar_one()


def _visible_file(tenant_id: str):
    return (File.tenant_id == tenant_id, File.deleted_at.is_(None),
            or_(File.expires_at.is_(None), File.expires_at > EPOCH_NOW))


def get_file(session: Session, tenant_id: str, file_id: str) -> File | None:
    """The tenant's live file ``file_id``, or None (another tenant's file is None too)."""
    if not can_exist(file_id):
        return None
    return session.execute(
        select(File).where(File.id == file_id, *_visible_file(tenant_id))
    ).scalar_one_or_none()


def _page(session: Session, stmt: Select, model, tenant_id: str, after: str | None, limit: int,
          descending: bool, extra=()) -> tuple[list, bool] | None:
    """One page of ``stmt`` ordered by ``seq``; None when ``after`` names no visible object."""
    if after is not None:
        if not can_exist(after):
            return None
        cursor = session.execute(
            select(model.seq).where(model.id == after, model.tenant_id == tenant_id, *extra)
        ).scalar_one_or_none()
        if cursor is None:
            return None
        stmt = stmt.where(model.seq < cursor if descending else model.seq > cursor)
    stmt = stmt.order_by(model.seq.desc() if descending else model.seq.asc()).limit(limit + 1)
    rows = list(session.execute(stmt).scalars())
    return rows[:limit], len(rows) > limit


def list_files(session: Session, tenant_id: str, *, purpose: str | None, limit: int,
               order: str, after: str | None) -> tuple[list[File], bool] | None:
    """A page of the tenant's live files and whether more follow; None for an unknown cursor."""
    visible = _visible_file(tenant_id)
    stmt = select(File).where(*visible)
    if purpose is not None:
        stmt = stmt.where(File.purpose == purpose)
    return _page(session, stmt, File, tenant_id, after, limit, order == "desc", visible)


def delete_file(session: Session, tenant_id: str, file_id: str) -> File | None:
    """Hide the tenant's file from the API; returns it, or None when not found.

    The caller removes the bytes unless :func:`file_in_use` says a running batch still reads them.
    """
    if not can_exist(file_id):
        return None
    return session.execute(
        update(File)
        .where(File.id == file_id, *_visible_file(tenant_id))
        .values(deleted_at=EPOCH_NOW)
        .returning(File)
    ).scalar_one_or_none()


def file_in_use(session: Session, file_id: str) -> bool:
    """Whether a non-terminal batch reads ``file_id`` as its input."""
    return session.execute(
        select(func.count()).select_from(Batch).where(
            Batch.input_file_id == file_id, Batch.status.in_(ACTIVE_BATCH_STATUSES)
        )
    ).scalar_one() > 0


# --- batches ----------------------------------------------------------------------------------


def add_event(session: Session, batch: Batch | None, type_: str, payload: dict | None = None,
              *, publish: bool = False) -> Event:
    """Append an event (timeline entry; an outbox entry when ``publish``)."""
    event = Event(batch_id=batch.id if batch else None, tenant_id=batch.tenant_id if batch else None,
                  type=type_, payload=payload or {}, needs_publish=publish)
    if batch is not None and type_ in WEBHOOK_EVENTS:  # due now when the tenant has a webhook
        event.webhook_next_at = (select(func.now()).where(Tenant.id == batch.tenant_id,
                                                          Tenant.webhook_url.is_not(None))
                                 .scalar_subquery())
    session.add(event)
    session.flush()
    return event


def insert_batch(session: Session, *, tenant_id: str, endpoint: str, input_file_id: str,
                 completion_window: str, window_seconds: int, metadata: dict | None,
                 output_expires_after: dict | None, idempotency_key: str | None,
                 request_hash: str | None, reserved_tokens: int = 0, traceparent: str | None = None) -> Batch:
    """Insert a batch in ``validating`` with its outbox event (validate task) in the same
    transaction. ``expires_at``/``deadline`` = database now + ``window_seconds``;
    ``reserved_tokens`` hold the tenant's quota until validation counts the real estimate.
    ``traceparent`` (W3C trace context of the create request) is kept in the ``batch.created``
    event's payload; :func:`batch_traceparents` reads it back.

    Raises ``sqlalchemy.exc.IntegrityError`` when the tenant already used ``idempotency_key``.
    """
    batch = session.execute(
        pg_insert(Batch)
        .values(
            id=new_id("batch_"), tenant_id=tenant_id, endpoint=endpoint,
            input_file_id=input_file_id, completion_window=completion_window,
            window_seconds=window_seconds,
            expires_at=text(f"extract(epoch from now())::bigint + {int(window_seconds)}"),
            deadline=text(f"now() + interval '{int(window_seconds)} seconds'"),
            metadata_=metadata, output_expires_after=output_expires_after,
            idempotency_key=idempotency_key, request_hash=request_hash, enqueued_tokens=reserved_tokens,
        )
        .returning(Batch)
    ).scalar_one()
    add_event(session, batch, "batch.created",
              {"task": VALIDATE_BATCH_TASK, **({"traceparent": traceparent} if traceparent else {})}, publish=True)
    return batch


def get_batch(session: Session, tenant_id: str, batch_id: str) -> Batch | None:
    """The tenant's batch ``batch_id``, or None (another tenant's batch is None too)."""
    if not can_exist(batch_id):
        return None
    return session.execute(
        select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id)
    ).scalar_one_or_none()


def get_batch_by_idempotency_key(session: Session, tenant_id: str, key: str) -> Batch | None:
    """The tenant's batch created with ``Idempotency-Key: key``, or None."""
    return session.execute(
        select(Batch).where(Batch.tenant_id == tenant_id, Batch.idempotency_key == key)
    ).scalar_one_or_none()


def list_batches(session: Session, tenant_id: str, *, limit: int,
                 after: str | None) -> tuple[list[Batch], bool] | None:
    """A page of the tenant's batches, newest first; None for an unknown cursor."""
    stmt = select(Batch).where(Batch.tenant_id == tenant_id)
    return _page(session, stmt, Batch, tenant_id, after, limit, True)


def enqueued_tokens(session: Session, tenant_id: str, exclude: str | None = None) -> int:
    """Estimated prompt tokens of the tenant's batches that have not ended (other than
    ``exclude``)."""
    stmt = select(func.coalesce(func.sum(Batch.enqueued_tokens), 0)).where(
        Batch.tenant_id == tenant_id, Batch.status.in_(ACTIVE_BATCH_STATUSES))
    if exclude is not None:
        stmt = stmt.where(Batch.id != exclude)
    return session.execute(stmt).scalar_one()


def lock_tenant(session: Session, tenant_id: str) -> Tenant:
    """The tenant row, locked until the transaction ends (serialises quota checks)."""
    return session.execute(select(Tenant).where(Tenant.id == tenant_id).with_for_update()).scalar_one()


def transition(session: Session, batch_id: str, from_: Sequence[str], to: str,
               event_payload: dict | None = None, **values) -> Batch | None:
    """Move the batch from one of ``from_`` to ``to`` in one guarded UPDATE, setting ``{to}_at``
    to the database's now and any extra column ``values``; returns the updated batch, or None when
    the batch was not in ``from_`` (someone else moved it first). Writes a ``batch.{to}`` event.
    """
    batch = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(tuple(from_)))
        .values(status=to, **{f"{to}_at": EPOCH_NOW}, **values)
        .returning(Batch)
        .execution_options(synchronize_session=False, populate_existing=True)
    ).scalar_one_or_none()
    if batch is not None:
        add_event(session, batch, f"batch.{to}", event_payload)
    return batch


def cancel_refusal(status: str) -> str | None:
    """Why a batch whose :func:`cancel_batch` left it in ``status`` was not cancellable (the
    message ``POST /v1/batches/{id}/cancel`` answers with 409, and the dashboard shows), or None
    when it is cancelling or cancelled."""
    if status in ("cancelling", "cancelled"):
        return None
    return f"Cannot cancel a batch with status '{status}'."


def cancel_batch(session: Session, tenant_id: str, batch_id: str) -> Batch | None:
    """Cancel the tenant's batch. Returns the batch after the change, or None when not found.

    A batch still ``validating``, or ``in_progress`` with no request handed out yet, goes straight
    to ``cancelled`` (``cancelling_at`` and ``cancelled_at`` both set, its requests marked
    ``cancelled``); one with work in flight goes to ``cancelling``. A batch already ``cancelling``
    or ``cancelled`` is returned unchanged; for other ended batches the caller answers an error.
    """
    if not can_exist(batch_id):
        return None
    batch = session.execute(
        select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id).with_for_update()
    ).scalar_one_or_none()
    if batch is None or batch.status not in ("validating", "in_progress"):
        return batch
    started = session.execute(
        select(func.count()).select_from(BatchRequest).where(
            BatchRequest.batch_id == batch_id, BatchRequest.state != "pending"
        )
    ).scalar_one()
    if started:
        moved = transition(session, batch_id, ("in_progress",), "cancelling")
        if moved is not None:
            add_event(session, moved, "batch.cancel_requested", {"task": CANCEL_BATCH_TASK}, publish=True)
        return moved
    session.execute(
        update(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state == "pending")
        .values(state="cancelled", finished_at=func.now())
    )
    return transition(session, batch_id, ("validating", "in_progress"), "cancelled",
                      cancelling_at=EPOCH_NOW)


def set_webhook(session: Session, tenant_name: str, url: str | None, secret: str | None) -> Tenant:
    """Set (or with ``url`` None, clear) the tenant's webhook endpoint and signing secret."""
    tenant = ensure_tenant(session, tenant_name)
    session.execute(update(Tenant).where(Tenant.id == tenant.id).values(webhook_url=url, webhook_secret=secret))
    return tenant


def due_webhooks(session: Session, limit: int = 50) -> list:
    """Webhook deliveries due now, locked (``SKIP LOCKED``): rows ``(event, url, secret)``."""
    return list(session.execute(
        select(Event, Tenant.webhook_url, Tenant.webhook_secret)
        .join(Tenant, Tenant.id == Event.tenant_id)
        .where(Event.webhook_next_at <= func.now(), Event.webhook_done_at.is_(None))
        .order_by(Event.webhook_next_at)
        .limit(limit)
        .with_for_update(of=Event, skip_locked=True)
    ).all())


def webhook_attempted(session: Session, event_id: int, delivered: bool, retry_in_seconds: float | None) -> None:
    """Record one delivery attempt: done when ``delivered`` or when ``retry_in_seconds`` is None
    (given up), else due again after ``retry_in_seconds``."""
    values: dict = {"webhook_attempts": Event.webhook_attempts + 1}
    if delivered or retry_in_seconds is None:
        values["webhook_done_at"] = func.now()
    else:
        values["webhook_next_at"] = func.now() + text(f"interval '{float(retry_in_seconds)} seconds'")
    session.execute(update(Event).where(Event.id == event_id).values(**values))


def stale_validating_batches(session: Session, older_than_seconds: float, limit: int = 100) -> list[str]:
    """Ids of batches still ``validating`` more than ``older_than_seconds`` after creation."""
    return list(session.execute(
        select(Batch.id)
        .where(Batch.status == "validating",
               Batch.created_at <= text(f"extract(epoch from now())::bigint - {int(older_than_seconds)}"))
        .order_by(Batch.seq)
        .limit(limit)
    ).scalars())


def purgeable_files(session: Session, limit: int = 500) -> list[File]:
    """Deleted or expired files whose bytes are still stored and that no non-terminal batch reads
    as input, locked (``SKIP LOCKED``) for the caller to purge."""
    in_use = select(Batch.input_file_id).where(Batch.status.in_(ACTIVE_BATCH_STATUSES))
    return list(session.execute(
        select(File)
        .where(File.purged_at.is_(None),
               or_(File.deleted_at.is_not(None), File.expires_at <= EPOCH_NOW),
               File.id.not_in(in_use))
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).scalars())


def mark_purged(session: Session, file_ids: Sequence[str]) -> None:
    """Record that these files' bytes are gone."""
    if file_ids:
        session.execute(update(File).where(File.id.in_(list(file_ids))).values(purged_at=EPOCH_NOW))


def unpublished_events(session: Session, older_than_seconds: float, limit: int = 100) -> list[Event]:
    """Outbox entries not yet handed to the broker and older than ``older_than_seconds``, locked
    (``SKIP LOCKED``) so that concurrent relays take different ones."""
    return list(session.execute(
        select(Event)
        .where(Event.needs_publish, Event.published_at.is_(None),
               Event.created_at < func.now() - text(f"interval '{float(older_than_seconds)} seconds'"))
        .order_by(Event.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).scalars())


def mark_published(session: Session, event_ids: Sequence[int]) -> None:
    """Record that these outbox entries reached the broker."""
    if event_ids:
        session.execute(update(Event).where(Event.id.in_(list(event_ids))).values(published_at=func.now()))


# --- batch requests (the workers' lifecycle) ---------------------------------------------------

TERMINAL_REQUEST_STATES = ("succeeded", "failed", "cancelled", "expired")


def feedable_batches(session: Session, limit: int = 100) -> list:
    """``in_progress`` batches, earliest deadline first, with how many of their requests are queued:
    rows ``(id, tenant_id, endpoint, model, expires_at, storage_key, queued)``."""
    queued = (select(func.count()).select_from(BatchRequest)
              .where(BatchRequest.batch_id == Batch.id, BatchRequest.state == "queued")
              .scalar_subquery())
    return list(session.execute(
        select(Batch.id, Batch.tenant_id, Batch.endpoint, Batch.model, Batch.expires_at,
               File.storage_key, queued.label("queued"))
        .join(File, File.id == Batch.input_file_id)
        .where(Batch.status == "in_progress", Batch.deadline > func.now())
        .order_by(Batch.deadline, Batch.seq)
        .limit(limit)
    ).all())


def claim_pending(session: Session, batch_id: str, count: int, lease_seconds: float) -> list:
    """Move up to ``count`` pending requests of the batch to ``queued`` with a new lease token and
    ``lease_expires_at`` = now + ``lease_seconds``, in prefix order (``prefix_key``, then line);
    rows ``(custom_id, line, byte_offset, byte_length, lease_token, attempts)`` in that order."""
    # A MATERIALIZED CTE runs the LIMIT … SKIP LOCKED once; as an IN (subquery) Postgres may run it
    # again per row and, skipping the rows it just locked, claim more than ``count``.
    picked = (select(BatchRequest.custom_id)
              .where(BatchRequest.batch_id == batch_id, BatchRequest.state == "pending")
              .order_by(BatchRequest.prefix_key, BatchRequest.line)
              .limit(count)
              .with_for_update(skip_locked=True)
              .cte("picked").prefix_with("MATERIALIZED"))
    rows = session.execute(
        update(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.custom_id == picked.c.custom_id)
        .values(state="queued", attempts=BatchRequest.attempts + 1,
                lease_token=func.gen_random_uuid(),
                lease_expires_at=func.now() + text(f"interval '{float(lease_seconds)} seconds'"))
        .returning(BatchRequest.custom_id, BatchRequest.line, BatchRequest.byte_offset,
                   BatchRequest.byte_length, BatchRequest.lease_token, BatchRequest.attempts,
                   BatchRequest.prefix_key)
        .execution_options(synchronize_session=False)
    ).all()
    return sorted(rows, key=lambda r: (r.prefix_key, r.line))


def record_outcome(session: Session, batch_id: str, custom_id: str, lease_token: str, *, state: str,
                   status_code: int | None = None, request_id: str | None = None,
                   response_body: bytes | None = None, error_code: str | None = None,
                   error_message: str | None = None, prompt_tokens: int = 0, cached_tokens: int = 0,
                   completion_tokens: int = 0, reasoning_tokens: int = 0) -> bool:
    """Record one request's outcome with a compare-and-set on ``state = 'queued'`` and the lease
    token, so a late or duplicate result is refused (returns False). ``state`` ``pending`` hands the
    request back to the feeder (a retryable failure); a terminal state also adds to the batch's
    ``request_counts`` and ``usage`` in the same transaction."""
    values: dict = {"state": state, "lease_token": None, "lease_expires_at": None}
    if state in TERMINAL_REQUEST_STATES:
        values.update(status_code=status_code, request_id=request_id, response_body=response_body,
                      error_code=error_code, error_message=error_message, prompt_tokens=prompt_tokens,
                      cached_tokens=cached_tokens, completion_tokens=completion_tokens,
                      finished_at=func.now())
    won = session.execute(
        update(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.custom_id == custom_id,
               BatchRequest.state == "queued", BatchRequest.lease_token == lease_token)
        .values(**values)
        .execution_options(synchronize_session=False)
    ).rowcount == 1
    if won and state in TERMINAL_REQUEST_STATES:
        succeeded = state == "succeeded"
        session.execute(
            update(Batch).where(Batch.id == batch_id).values(
                request_completed=Batch.request_completed + int(succeeded),
                request_failed=Batch.request_failed + int(not succeeded),
                usage_input_tokens=Batch.usage_input_tokens + prompt_tokens,
                usage_cached_tokens=Batch.usage_cached_tokens + cached_tokens,
                usage_output_tokens=Batch.usage_output_tokens + completion_tokens,
                usage_reasoning_tokens=Batch.usage_reasoning_tokens + reasoning_tokens,
            ).execution_options(synchronize_session=False)
        )
    return won


def count_requests(session: Session, batch_id: str, state: str) -> int:
    """How many requests of the batch are in ``state``."""
    return session.execute(
        select(func.count()).select_from(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state == state)
    ).scalar_one()


def lapsed_leases(session: Session, limit: int = 1000) -> list:
    """Queued requests whose lease ran out (their message or result was lost), locked:
    rows ``(batch_id, custom_id, lease_token, attempts)``."""
    return list(session.execute(
        select(BatchRequest.batch_id, BatchRequest.custom_id, BatchRequest.lease_token, BatchRequest.attempts)
        .where(BatchRequest.state == "queued", BatchRequest.lease_expires_at < func.now())
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all())


def batches_to_finalize(session: Session, limit: int = 100) -> list[str]:
    """Ids of batches with work left to end: ``in_progress`` with every request terminal,
    ``cancelling`` with nothing queued any more, ``finalizing`` (a finalisation that died), or any
    of these past their deadline (to expire)."""
    open_requests = (select(func.count()).select_from(BatchRequest)
                     .where(BatchRequest.batch_id == Batch.id,
                            BatchRequest.state.not_in(TERMINAL_REQUEST_STATES))
                     .scalar_subquery())
    queued = (select(func.count()).select_from(BatchRequest)
              .where(BatchRequest.batch_id == Batch.id, BatchRequest.state == "queued")
              .scalar_subquery())
    return list(session.execute(
        select(Batch.id).where(or_(
            (Batch.status == "in_progress") & (Batch.request_completed + Batch.request_failed >= Batch.request_total)
            & (open_requests == 0),
            (Batch.status == "cancelling") & (queued == 0),
            Batch.status == "finalizing",
            Batch.status.in_(("in_progress", "cancelling", "validating")) & (Batch.deadline <= func.now()),
        )).order_by(Batch.seq).limit(limit)
    ).scalars())


def end_open_requests(session: Session, batch_id: str, states: Sequence[str], to: str, error_code: str) -> int:
    """Give every request of the batch in ``states`` the terminal state ``to`` with a top-level
    ``error_code`` (``batch_expired``, ``batch_cancelled``), counting them as failed; returns how
    many."""
    ended = session.execute(
        update(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state.in_(tuple(states)))
        .values(state=to, error_code=error_code, lease_token=None, lease_expires_at=None,
                finished_at=func.now())
        .execution_options(synchronize_session=False)
    ).rowcount
    if ended:
        session.execute(update(Batch).where(Batch.id == batch_id)
                        .values(request_failed=Batch.request_failed + ended)
                        .execution_options(synchronize_session=False))
    return ended


OUTCOME_COLUMNS = "custom_id, state, status_code, request_id, response_body, error_code, error_message"


def request_outcomes(session: Session, batch_id: str, chunk: int = 1000):
    """Every request of the batch in input-file order, streamed through a server-side cursor in the
    binary protocol (``bytea`` bodies arrive as raw bytes, not hex text: half the bytes on the wire):
    tuples ``(custom_id, state, status_code, request_id, response_body, error_code, error_message)``."""
    raw = session.connection().connection.driver_connection
    with raw.cursor(name=f"outcomes_{secrets.token_hex(4)}", binary=True) as cursor:
        cursor.itersize = chunk
        cursor.execute(f"SELECT {OUTCOME_COLUMNS} FROM batch_requests WHERE batch_id = %s ORDER BY line",
                       (batch_id,))
        yield from cursor


def upsert_output_file(session: Session, *, file_id: str, tenant_id: str, size: int, filename: str,
                       storage_key: str, sha256: str, expires_after_seconds: int) -> None:
    """Register an output or error file (purpose ``batch_output``); a second call with the same id
    (a repeated finalisation) changes nothing."""
    session.execute(
        pg_insert(File)
        .values(id=file_id, tenant_id=tenant_id, bytes=size, filename=filename, purpose="batch_output",
                storage_key=storage_key, sha256=sha256,
                expires_at=text(f"extract(epoch from now())::bigint + {int(expires_after_seconds)}"))
        .on_conflict_do_nothing(index_elements=[File.id])
    )


# --- admin dashboard (every tenant; only the admin-key-protected /admin pages call these) -----

BatchCursor = tuple[int, str]
"""A keyset position in the admin job list: ``(created_at, id)`` of the last batch shown."""


def admin_list_batches(session: Session, *, limit: int, after: BatchCursor | None = None,
                       status: str | None = None, tenant_id: str | None = None) -> tuple[list, bool]:
    """A page of batches of every tenant, newest first (``created_at`` then ``id``, descending),
    after the keyset position ``after``, optionally of one ``status`` and/or one tenant: rows
    ``(Batch, tenant name)`` and whether more follow. Served by ``ix_batches_created_at_id`` (or its
    status / tenant twin), so a page reads ``limit + 1`` index entries whatever the table's size;
    counts come from the batch row, never from its requests."""
    stmt = select(Batch, Tenant.name).join(Tenant, Tenant.id == Batch.tenant_id)
    if status is not None:
        stmt = stmt.where(Batch.status == status)
    if tenant_id is not None:
        stmt = stmt.where(Batch.tenant_id == tenant_id)
    if after is not None:
        stmt = stmt.where(tuple_(Batch.created_at, Batch.id) < tuple_(after[0], after[1]))
    rows = list(session.execute(
        stmt.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
    ).all())
    return rows[:limit], len(rows) > limit


def admin_get_batch(session: Session, batch_id: str):
    """Row ``(Batch, tenant name)`` of any tenant's batch ``batch_id``, or None."""
    if not can_exist(batch_id):
        return None
    return session.execute(
        select(Batch, Tenant.name).join(Tenant, Tenant.id == Batch.tenant_id).where(Batch.id == batch_id)
    ).one_or_none()


def tenant_by_name(session: Session, name: str) -> Tenant | None:
    """The tenant called ``name``, or None."""
    return session.execute(select(Tenant).where(Tenant.name == name)).scalar_one_or_none()


def batch_events(session: Session, batch_id: str, limit: int = 200) -> list[Event]:
    """The batch's timeline: its first ``limit`` events, oldest first (``ix_events_batch_id_id``)."""
    return list(session.execute(
        select(Event).where(Event.batch_id == batch_id).order_by(Event.id).limit(limit)
    ).scalars())


def request_state_counts(session: Session, batch_id: str) -> dict[str, int]:
    """``{state: requests}`` of one batch (an index-only count on ``ix_batch_requests_batch_id_state``)."""
    return dict(session.execute(
        select(BatchRequest.state, func.count()).where(BatchRequest.batch_id == batch_id)
        .group_by(BatchRequest.state)
    ).all())


ERROR_BODY_BYTES = 65536
"""How much of a failed request's response body the job page reads for its error message (bytes;
an API error body is a few hundred)."""


def admin_request_page(session: Session, batch_id: str, *, limit: int, after: int | None = None,
                       state: str | None = None) -> tuple[list, bool]:
    """A page of the batch's requests in input order (``line``), after the line ``after``, optionally
    in one ``state``: rows ``(custom_id, line, state, attempts, status_code, error_code,
    error_message, error_body, prompt_tokens, completion_tokens, finished_at)`` and whether more
    follow. ``error_body`` is the first :data:`ERROR_BODY_BYTES` of the response body of a request
    answered with HTTP ≥ 400 and no ``error_message`` (else None); other bodies are not read."""
    error_body = case((and_(BatchRequest.status_code >= 400, BatchRequest.error_message.is_(None)),
                       func.substring(BatchRequest.response_body, 1, ERROR_BODY_BYTES)))
    stmt = select(BatchRequest.custom_id, BatchRequest.line, BatchRequest.state, BatchRequest.attempts,
                  BatchRequest.status_code, BatchRequest.error_code, BatchRequest.error_message,
                  error_body.label("error_body"), BatchRequest.prompt_tokens, BatchRequest.completion_tokens,
                  BatchRequest.finished_at).where(BatchRequest.batch_id == batch_id)
    if state is not None:
        stmt = stmt.where(BatchRequest.state == state)
    if after is not None:
        stmt = stmt.where(BatchRequest.line > after)
    rows = list(session.execute(stmt.order_by(BatchRequest.line).limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit


def get_any_file(session: Session, file_id: str) -> File | None:
    """Any tenant's file ``file_id`` whose bytes are still stored, or None (admin downloads)."""
    if not can_exist(file_id):
        return None
    return session.execute(select(File).where(File.id == file_id, File.purged_at.is_(None))).scalar_one_or_none()


def tenant_names(session: Session, limit: int = 500) -> list[str]:
    """Tenant names in alphabetical order (at most ``limit``), for the dashboard's filter."""
    return list(session.execute(select(Tenant.name).order_by(Tenant.name).limit(limit)).scalars())


def tenant_usage(session: Session, *, limit: int, after: str | None = None) -> tuple[list, bool]:
    """A page of tenants by name, after the name ``after``: rows ``(id, name, enqueued_token_limit,
    reserved_tokens, active_batches)`` (reserved = enqueued tokens of the tenant's batches that have
    not ended, read through ``ix_batches_status_deadline``) and whether more follow."""
    active = (select(Batch.tenant_id, func.sum(Batch.enqueued_tokens).label("reserved"),
                     func.count().label("batches"))
              .where(Batch.status.in_(ACTIVE_BATCH_STATUSES)).group_by(Batch.tenant_id).subquery())
    stmt = (select(Tenant.id, Tenant.name, Tenant.enqueued_token_limit,
                   func.coalesce(active.c.reserved, 0).label("reserved_tokens"),
                   func.coalesce(active.c.batches, 0).label("active_batches"))
            .outerjoin(active, active.c.tenant_id == Tenant.id))
    if after is not None:
        stmt = stmt.where(Tenant.name > after)
    rows = list(session.execute(stmt.order_by(Tenant.name).limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit


OPEN_REQUEST_STATES = ("pending", "queued")
"""Requests not yet ended: ``pending`` (in Postgres, not yet fed to the queue) and ``queued``
(handed to the processors, no result yet). No other non-terminal state exists."""


def open_requests_by_tenant(session: Session, tenant_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """``{tenant_id: {"pending" | "queued": requests}}`` of requests not yet ended. Only batches
    ``in_progress`` or ``cancelling`` can hold such requests, so the count starts from those
    (``ix_batches_status_deadline``) and reaches their requests through
    ``ix_batch_requests_batch_id_state``: ended batches' requests are never scanned."""
    if not tenant_ids:
        return {}
    rows = session.execute(
        select(Batch.tenant_id, BatchRequest.state, func.count())
        .join(BatchRequest, BatchRequest.batch_id == Batch.id)
        .where(Batch.status.in_(("in_progress", "cancelling")), Batch.tenant_id.in_(list(tenant_ids)),
               BatchRequest.state.in_(OPEN_REQUEST_STATES))
        .group_by(Batch.tenant_id, BatchRequest.state)
    ).all()
    out: dict[str, dict[str, int]] = {}
    for tenant_id, state, count in rows:
        out.setdefault(tenant_id, {})[state] = count
    return out


def batch_traceparents(session: Session, batch_ids: Sequence[str]) -> dict[str, str]:
    """``{batch_id: traceparent}`` of the given batches created with a trace context (the
    ``batch.created`` event's payload, found through ``ix_events_batch_id_id``)."""
    if not batch_ids:
        return {}
    value = Event.payload["traceparent"].astext
    return dict(session.execute(
        select(Event.batch_id, value)
        .where(Event.batch_id.in_(list(batch_ids)), Event.type == "batch.created", value.is_not(None))
    ).all())


def batch_status_counts(session: Session) -> dict[str, int]:
    """``{status: batches}`` over every tenant (one grouped count; the gateway's metrics cache it)."""
    return dict(session.execute(select(Batch.status, func.count()).group_by(Batch.status)).all())

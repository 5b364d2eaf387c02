"""SQLAlchemy 2 models: the record of every tenant, key, file, batch and batch request.

Postgres is the record (DESIGN.md). Timestamps that OpenAI shows are Unix seconds (``BigInteger``)
taken from the database clock; leases and deadlines are ``timestamptz`` for the same reason. The
schema changes only through Alembic (``migrations/``); ``tests/migration`` checks the two agree.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from batch_gateway.store.states import BatchStatus, RequestState

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

EPOCH_NOW = text("extract(epoch from now())::bigint")



class Base(DeclarativeBase):
    """Declarative base with stable constraint names (so Alembic diffs are clean)."""

    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    """A customer: owns keys, files and batches. ``enqueued_token_limit`` and
    ``queued_response_limit`` (background responses still queued) null = the default;
    ``webhook_url``/``webhook_secret`` (``whsec_…``) receive signed terminal-state events."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(256), unique=True)
    enqueued_token_limit: Mapped[int | None] = mapped_column(BigInteger)
    queued_response_limit: Mapped[int | None] = mapped_column(Integer)
    webhook_url: Mapped[str | None] = mapped_column(Text)
    webhook_secret: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[int] = mapped_column(BigInteger, server_default=EPOCH_NOW)


class ApiKey(Base):
    """An API key, stored as the SHA-256 hex of the key; ``prefix`` is the first 12 characters."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[int] = mapped_column(BigInteger, server_default=EPOCH_NOW)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger)


class File(Base):
    """An uploaded or produced file. Bytes live in the file store under ``storage_key``.

    ``seq`` orders lists and resolves ``after`` cursors. A deleted or expired file is invisible to
    the API at once; it keeps its row, and its bytes until no running batch reads them, when the
    purge task removes them and sets ``purged_at``.
    """

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, Identity(), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger, server_default=EPOCH_NOW)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), server_default="processed")
    status_details: Mapped[str | None] = mapped_column(Text)
    storage_key: Mapped[str] = mapped_column(String(256))
    sha256: Mapped[str | None] = mapped_column(String(64))
    deleted_at: Mapped[int | None] = mapped_column(BigInteger)
    purged_at: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        Index(None, "tenant_id", "purpose", "seq"),
        Index("ix_files_purgeable", "expires_at", postgresql_where=text("purged_at IS NULL")),
    )


class Batch(Base):
    """A batch: OpenAI's 22 fields plus tenant, deadline, idempotency key, enqueued tokens, usage.

    Every status change (``batch_gateway.store.states``) is one guarded UPDATE in
    ``batch_gateway.store.queries``; each ``*_at`` is set
    once. ``request_total/completed/failed`` are ``request_counts``; the ``usage_*`` columns are
    ``usage``.
    """

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, Identity(), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(256))
    errors: Mapped[list | None] = mapped_column(JSONB)
    input_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    completion_window: Mapped[str] = mapped_column(String(16))
    window_seconds: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), server_default=BatchStatus.VALIDATING.value)
    output_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    error_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    created_at: Mapped[int] = mapped_column(BigInteger, server_default=EPOCH_NOW)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)
    failed_at: Mapped[int | None] = mapped_column(BigInteger)
    expired_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger)
    deadline: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    request_total: Mapped[int] = mapped_column(Integer, server_default="0")
    request_completed: Mapped[int] = mapped_column(Integer, server_default="0")
    request_failed: Mapped[int] = mapped_column(Integer, server_default="0")
    usage_input_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    usage_cached_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    usage_output_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    usage_reasoning_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSONB)
    output_expires_after: Mapped[dict | None] = mapped_column(JSONB)
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    enqueued_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")

    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index(None, "tenant_id", "seq"),
        Index(None, "status", "deadline"),
        # the admin dashboard's job list: newest first, keyset on (created_at, id), by status or tenant
        Index(None, "created_at", "id"),
        Index(None, "status", "created_at", "id"),
        Index(None, "tenant_id", "created_at", "id"),
    )


class BatchRequest(Base):
    """One request of a batch, keyed by ``(batch_id, custom_id)``.

    ``line``/``byte_offset``/``byte_length`` locate the request's JSON in the input file (bytes);
    ``prefix_key`` (first 128 bytes of the prompt text) orders feeding by shared prefix.
    ``state``: ``pending`` (not fed yet) → ``queued`` (on a processor lane, no result yet) →
    ``succeeded`` | ``failed`` | ``cancelled``
    | ``expired``; ``lease_token``/``lease_expires_at`` guard result writes (compare-and-set);
    ``queue_entry_id``: the stream entry id of the queued message (the sweeper asks the queue where
    it is before handing the request back; null until the publish is recorded).
    """

    __tablename__ = "batch_requests"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    custom_id: Mapped[str] = mapped_column(Text, primary_key=True)
    line: Mapped[int] = mapped_column(Integer)
    byte_offset: Mapped[int] = mapped_column(BigInteger)
    byte_length: Mapped[int] = mapped_column(Integer)
    prefix_key: Mapped[bytes] = mapped_column(LargeBinary)
    est_tokens: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), server_default=RequestState.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    lease_token: Mapped[str | None] = mapped_column(UUID(as_uuid=False))
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    queue_entry_id: Mapped[str | None] = mapped_column(String(64))
    status_code: Mapped[int | None] = mapped_column(Integer)
    request_id: Mapped[str | None] = mapped_column(String(128))
    response_body: Mapped[bytes | None] = mapped_column(LargeBinary)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index(None, "batch_id", "state"),)


class Event(Base):
    """Outbox and timeline: one row per status change or task to hand off, written in the same
    transaction as the change. ``published_at`` null = not yet handed to the broker. Terminal batch
    events are also webhook deliveries: ``webhook_next_at`` set = due then, ``webhook_done_at`` set =
    delivered (or given up)."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    tenant_id: Mapped[str | None] = mapped_column(String(64))
    type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    needs_publish: Mapped[bool] = mapped_column(Boolean, server_default="false")
    published_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    webhook_attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    webhook_next_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    webhook_done_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index(None, "batch_id", "id"),
        Index("ix_events_unpublished", "id", postgresql_where=text("needs_publish AND published_at IS NULL")),
        Index("ix_events_webhook_due", "webhook_next_at",
              postgresql_where=text("webhook_next_at IS NOT NULL AND webhook_done_at IS NULL")),
    )


class BackgroundResponse(Base):
    """A background response (OpenAI's ``POST /v1/responses`` with ``background: true``), the
    record behind its Response object.

    ``request``: the create body as the client sent it (echoed fields: ``instructions``,
    ``temperature``, ``metadata``, …); ``input``: the input items the model sees (with
    ``previous_response_id``, the previous response's input and output before this request's
    input); ``output`` / ``usage`` / ``error`` / ``incomplete_details``: OpenAI's fields, null until
    the result is collected. ``status`` (:class:`~batch_gateway.store.states.ResponseStatus`)
    changes only by guarded UPDATEs in :mod:`batch_gateway.store.queries.responses`.
    ``created_at``/``in_progress_at``/``finished_at`` are Unix seconds (database clock);
    ``deadline``: a response still queued then expires. ``queue_entry_id``: the async lane's stream
    entry id once published (null: not published yet).
    """

    __tablename__ = "background_responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, Identity(), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), server_default="queued")
    model: Mapped[str] = mapped_column(String(256))
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    request: Mapped[dict] = mapped_column(JSONB)
    input: Mapped[list] = mapped_column(JSONB)
    output: Mapped[list | None] = mapped_column(JSONB)
    usage: Mapped[dict | None] = mapped_column(JSONB)
    error: Mapped[dict | None] = mapped_column(JSONB)
    incomplete_details: Mapped[dict | None] = mapped_column(JSONB)
    created_at: Mapped[int] = mapped_column(BigInteger, server_default=EPOCH_NOW)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)
    deadline: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    queue_entry_id: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        Index(None, "tenant_id", "status"),
        Index(None, "status", "deadline"),
        Index(None, "tenant_id", "seq"),
    )

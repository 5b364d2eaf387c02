"""Queries on ``batches``: create, read, list, quota sums, the guarded status change
(:func:`transition`), cancel, and the candidates of the lifecycle steps.

None commits: the caller owns the transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from batch_gateway.store.models import (
    EPOCH_NOW,
    Batch,
    BatchRequest,
    File,
)
from batch_gateway.store.queries._shared import can_exist, new_id, page
from batch_gateway.store.queries.events import add_event
from batch_gateway.store.states import (
    ACTIVE_BATCH_STATUSES,
    CANCELLABLE_STATUSES,
    EXPIRABLE_STATUSES,
    TERMINAL_BATCH_STATUSES,
    TERMINAL_REQUEST_STATES,
    BatchStatus,
    RequestState,
)
from batch_gateway.store.task_names import CANCEL_BATCH_TASK, VALIDATE_BATCH_TASK


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
    return page(session, stmt, Batch, tenant_id, after, limit, True)


def enqueued_tokens(session: Session, tenant_id: str, exclude: str | None = None) -> int:
    """Estimated prompt tokens of the tenant's batches that have not ended (other than
    ``exclude``)."""
    stmt = select(func.coalesce(func.sum(Batch.enqueued_tokens), 0)).where(
        Batch.tenant_id == tenant_id, Batch.status.in_(ACTIVE_BATCH_STATUSES))
    if exclude is not None:
        stmt = stmt.where(Batch.id != exclude)
    return session.execute(stmt).scalar_one()


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


CANCEL_RULE = """A cancel acts on a batch that has not ended and refuses one that has, whatever the
way it ended: ``validating`` (or ``in_progress`` with nothing handed out) → ``cancelled`` at once;
``in_progress`` with work in flight → ``cancelling``; ``cancelling`` → answered unchanged (200: a
retried cancel while the first one runs); ``completed``, ``failed``, ``expired`` and ``cancelled``
→ 409 ``Cannot cancel a batch with status '<status>'.``, nothing changed. OpenAI answers a cancel
of a completed batch with this 409 (its cancel endpoint is documented for in-progress batches
only); a batch that already ended cancelled is refused the same way, as every ended batch."""


def terminal_cancel_refusal(status: str) -> str:
    """OpenAI's 409 message for a cancel of a batch in ``status``."""
    return f"Cannot cancel a batch with status '{status}'."


@dataclass(frozen=True)
class CancelOutcome:
    """What :func:`request_cancel` did: ``batch`` after the call and ``found``, the status it had
    when the cancel locked it."""

    batch: Batch
    found: str

    @property
    def refusal(self) -> str | None:
        """The 409 message when the batch had already ended (:data:`CANCEL_RULE`), else None."""
        return terminal_cancel_refusal(self.found) if self.found in TERMINAL_BATCH_STATUSES else None


def request_cancel(session: Session, tenant_id: str, batch_id: str) -> CancelOutcome | None:
    """Cancel the tenant's batch by :data:`CANCEL_RULE`; None when there is no such batch.

    A batch still ``validating``, or ``in_progress`` with no request handed out yet, goes straight
    to ``cancelled`` (``cancelling_at`` and ``cancelled_at`` both set, its requests marked
    ``cancelled``); one with work in flight goes to ``cancelling`` (with the cancel task's outbox
    event). Any other batch is returned unchanged; the caller answers :attr:`CancelOutcome.refusal`
    when it is set.
    """
    if not can_exist(batch_id):
        return None
    batch = session.execute(
        select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id).with_for_update()
    ).scalar_one_or_none()
    if batch is None:
        return None
    found = str(batch.status)
    if batch.status not in CANCELLABLE_STATUSES:
        return CancelOutcome(batch, found)
    started = session.execute(
        select(func.count()).select_from(BatchRequest).where(
            BatchRequest.batch_id == batch_id, BatchRequest.state != RequestState.PENDING
        )
    ).scalar_one()
    if started:
        moved = transition(session, batch_id, (BatchStatus.IN_PROGRESS,), BatchStatus.CANCELLING)
        if moved is not None:
            add_event(session, moved, "batch.cancel_requested", {"task": CANCEL_BATCH_TASK}, publish=True)
        return CancelOutcome(moved or batch, found)
    session.execute(
        update(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.PENDING)
        .values(state=RequestState.CANCELLED, finished_at=func.now())
    )
    moved = transition(session, batch_id, CANCELLABLE_STATUSES, BatchStatus.CANCELLED, cancelling_at=EPOCH_NOW)
    return CancelOutcome(moved or batch, found)


def stale_validating_batches(session: Session, older_than_seconds: float, limit: int = 100) -> list[str]:
    """Ids of batches still ``validating`` more than ``older_than_seconds`` after creation."""
    return list(session.execute(
        select(Batch.id)
        .where(Batch.status == BatchStatus.VALIDATING,
               Batch.created_at <= text(f"extract(epoch from now())::bigint - {int(older_than_seconds)}"))
        .order_by(Batch.seq)
        .limit(limit)
    ).scalars())


def feedable_batches(session: Session, limit: int = 100) -> list:
    """``in_progress`` batches, earliest deadline first, with how many of their requests are queued:
    rows ``(id, tenant_id, endpoint, model, expires_at, storage_key, queued)``."""
    queued = (select(func.count()).select_from(BatchRequest)
              .where(BatchRequest.batch_id == Batch.id, BatchRequest.state == RequestState.QUEUED)
              .scalar_subquery())
    return list(session.execute(
        select(Batch.id, Batch.tenant_id, Batch.endpoint, Batch.model, Batch.expires_at,
               File.storage_key, queued.label("queued"))
        .join(File, File.id == Batch.input_file_id)
        .where(Batch.status == BatchStatus.IN_PROGRESS, Batch.deadline > func.now())
        .order_by(Batch.deadline, Batch.seq)
        .limit(limit)
    ).all())


def batches_to_finalize(session: Session, limit: int = 100) -> list[str]:
    """Ids of batches with work left to end, oldest first: the candidates of
    :func:`batch_gateway.store.states.finalize_target`, selected with its sets: an expirable batch
    past its deadline, ``in_progress`` with every request terminal, ``cancelling`` with nothing
    queued any more, ``finalizing`` (a finalisation that died)."""
    open_requests = (select(func.count()).select_from(BatchRequest)
                     .where(BatchRequest.batch_id == Batch.id,
                            BatchRequest.state.not_in(TERMINAL_REQUEST_STATES))
                     .scalar_subquery())
    queued = (select(func.count()).select_from(BatchRequest)
              .where(BatchRequest.batch_id == Batch.id, BatchRequest.state == RequestState.QUEUED)
              .scalar_subquery())
    return list(session.execute(
        select(Batch.id).where(or_(
            Batch.status.in_(EXPIRABLE_STATUSES) & (Batch.deadline <= func.now()),
            (Batch.status == BatchStatus.IN_PROGRESS)
            & (Batch.request_completed + Batch.request_failed >= Batch.request_total) & (open_requests == 0),
            (Batch.status == BatchStatus.CANCELLING) & (queued == 0),
            Batch.status == BatchStatus.FINALIZING,
        )).order_by(Batch.seq).limit(limit)
    ).scalars())


def lock_batch(session: Session, batch_id: str) -> Batch | None:
    """Any tenant's batch ``batch_id``, locked until the transaction ends, or None."""
    return session.get(Batch, batch_id, with_for_update=True)


def past_deadline(session: Session, batch: Batch) -> bool:
    """Whether the database's now is at or past the batch's ``deadline``."""
    return bool(session.execute(select(batch.deadline <= func.now())).scalar_one())


def batch_status(session: Session, batch_id: str) -> str | None:
    """The status of any tenant's batch ``batch_id``, or None when there is none."""
    return session.execute(select(Batch.status).where(Batch.id == batch_id)).scalar_one_or_none()


def cancelling_batch_ids(session: Session) -> set[str]:
    """Ids of every batch in ``cancelling``."""
    return set(session.execute(select(Batch.id).where(Batch.status == BatchStatus.CANCELLING)).scalars())

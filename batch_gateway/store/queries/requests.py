"""Queries on ``batch_requests``: the COPY of validated requests, leases (claim, the queue entry
of the published message, record, sweep, renew), ending open requests, and the outcome stream
files are built from.

None commits: the caller owns the transaction."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.orm import Session

from batch_gateway.store.models import (
    Batch,
    BatchRequest,
)
from batch_gateway.store.queries._shared import rowcount
from batch_gateway.store.states import TERMINAL_REQUEST_STATES, RequestState

RequestRow = tuple[str, int, int, int, bytes, int]
"""A validated request as written: ``(custom_id, line, byte_offset, byte_length, prefix_key, est_tokens)``."""


def claim_pending(session: Session, batch_id: str, count: int, lease_seconds: float) -> list:
    """Move up to ``count`` pending requests of the batch to ``queued`` with a new lease token and
    ``lease_expires_at`` = now + ``lease_seconds``, in prefix order (``prefix_key``, then line);
    rows ``(custom_id, line, byte_offset, byte_length, lease_token, attempts)`` in that order; the
    queue entry id is cleared until :func:`record_queue_entries` records the new message's."""
    # A MATERIALIZED CTE runs the LIMIT … SKIP LOCKED once; as an IN (subquery) Postgres may run it
    # again per row and, skipping the rows it just locked, claim more than ``count``.
    picked = (select(BatchRequest.custom_id)
              .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.PENDING)
              .order_by(BatchRequest.prefix_key, BatchRequest.line)
              .limit(count)
              .with_for_update(skip_locked=True)
              .cte("picked").prefix_with("MATERIALIZED"))
    rows = session.execute(
        update(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.custom_id == picked.c.custom_id)
        .values(state=RequestState.QUEUED, attempts=BatchRequest.attempts + 1,
                lease_token=func.gen_random_uuid(), queue_entry_id=None,
                lease_expires_at=func.now() + text(f"interval '{float(lease_seconds)} seconds'"))
        .returning(BatchRequest.custom_id, BatchRequest.line, BatchRequest.byte_offset,
                   BatchRequest.byte_length, BatchRequest.lease_token, BatchRequest.attempts,
                   BatchRequest.prefix_key)
        .execution_options(synchronize_session=False)
    ).all()
    return sorted(rows, key=lambda r: (r.prefix_key, r.line))


_RECORD_ENTRIES = text(
    "UPDATE batch_requests AS r SET queue_entry_id = v.entry_id "
    "FROM unnest(CAST(:custom_ids AS text[]), CAST(:tokens AS uuid[]), CAST(:entries AS text[])) "
    "AS v(custom_id, lease_token, entry_id) "
    "WHERE r.batch_id = :batch_id AND r.custom_id = v.custom_id AND r.lease_token = v.lease_token "
    "AND r.state = 'queued'"
)


def record_queue_entries(session: Session, batch_id: str, entries: Sequence[tuple[str, str, str]]) -> int:
    """Record the stream entry id of each published message, ``(custom_id, lease_token,
    entry_id)``, on its request while that lease holds (a request handed back or answered since
    keeps what it has); returns how many rows took it."""
    if not entries:
        return 0
    custom_ids, tokens, entry_ids = (list(column) for column in zip(*entries))
    return rowcount(session.execute(_RECORD_ENTRIES, {"batch_id": batch_id, "custom_ids": custom_ids,
                                                      "tokens": tokens, "entries": entry_ids}))


_RENEW_LEASES = text(
    "UPDATE batch_requests AS r SET lease_expires_at = now() + make_interval(secs => :seconds) "
    "FROM unnest(CAST(:batch_ids AS text[]), CAST(:custom_ids AS text[]), CAST(:tokens AS uuid[])) "
    "AS v(batch_id, custom_id, lease_token) "
    "WHERE r.batch_id = v.batch_id AND r.custom_id = v.custom_id AND r.lease_token = v.lease_token "
    "AND r.state = 'queued'"
)


def renew_leases(session: Session, leases: Sequence[tuple[str, str, str]], lease_seconds: float) -> int:
    """Give each ``(batch_id, custom_id, lease_token)`` still queued under that lease a new
    ``lease_expires_at`` = now + ``lease_seconds``, keeping its token and ``attempts`` (its message
    is still on its way); returns how many were renewed."""
    if not leases:
        return 0
    batch_ids, custom_ids, tokens = (list(column) for column in zip(*leases))
    return rowcount(session.execute(_RENEW_LEASES, {"seconds": float(lease_seconds), "batch_ids": batch_ids,
                                                    "custom_ids": custom_ids, "tokens": tokens}))


def record_outcome(session: Session, batch_id: str, custom_id: str, lease_token: str, *, state: str,
                   status_code: int | None = None, request_id: str | None = None,
                   response_body: bytes | None = None, error_code: str | None = None,
                   error_message: str | None = None, prompt_tokens: int = 0, cached_tokens: int = 0,
                   completion_tokens: int = 0, reasoning_tokens: int = 0) -> bool:
    """Record one request's outcome with a compare-and-set on ``state = 'queued'`` and the lease
    token, so a late or duplicate result is refused (returns False). ``state`` ``pending`` hands the
    request back to the feeder (a retryable failure); a terminal state also adds to the batch's
    ``request_counts`` and ``usage`` in the same transaction."""
    values: dict = {"state": state, "lease_token": None, "lease_expires_at": None, "queue_entry_id": None}
    if state in TERMINAL_REQUEST_STATES:
        values.update(status_code=status_code, request_id=request_id, response_body=response_body,
                      error_code=error_code, error_message=error_message, prompt_tokens=prompt_tokens,
                      cached_tokens=cached_tokens, completion_tokens=completion_tokens,
                      finished_at=func.now())
    won = rowcount(session.execute(
        update(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.custom_id == custom_id,
               BatchRequest.state == RequestState.QUEUED, BatchRequest.lease_token == lease_token)
        .values(**values)
        .execution_options(synchronize_session=False)
    )) == 1
    if won and state in TERMINAL_REQUEST_STATES:
        succeeded = state == RequestState.SUCCEEDED
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
    """Queued requests whose lease ran out (the sweeper asks the queue whether their message is
    still there), locked: rows ``(batch_id, custom_id, lease_token, attempts, queue_entry_id)``."""
    return list(session.execute(
        select(BatchRequest.batch_id, BatchRequest.custom_id, BatchRequest.lease_token, BatchRequest.attempts,
               BatchRequest.queue_entry_id)
        .where(BatchRequest.state == RequestState.QUEUED, BatchRequest.lease_expires_at < func.now())
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all())


def end_open_requests(session: Session, batch_id: str, states: Sequence[str], to: str, error_code: str) -> int:
    """Give every request of the batch in ``states`` the terminal state ``to`` with a top-level
    ``error_code`` (``batch_expired``, ``batch_cancelled``), counting them as failed; returns how
    many."""
    ended = rowcount(session.execute(
        update(BatchRequest)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state.in_(tuple(states)))
        .values(state=to, error_code=error_code, lease_token=None, lease_expires_at=None, queue_entry_id=None,
                finished_at=func.now())
        .execution_options(synchronize_session=False)
    ))
    if ended:
        session.execute(update(Batch).where(Batch.id == batch_id)
                        .values(request_failed=Batch.request_failed + ended)
                        .execution_options(synchronize_session=False))
    return ended


COPY_REQUESTS = (
    "COPY batch_requests (batch_id, custom_id, line, byte_offset, byte_length, prefix_key, est_tokens) "
    "FROM STDIN"
)


def replace_requests(session: Session, batch_id: str, rows: Iterable[RequestRow]) -> None:
    """Make ``rows`` the batch's requests (all ``pending``): delete any it had (a validation run
    again), then write the rows with one COPY. ``rows`` are ``(custom_id, line, byte_offset,
    byte_length, prefix_key, est_tokens)`` in input order (bytes, tokens)."""
    session.execute(delete(BatchRequest).where(BatchRequest.batch_id == batch_id))
    raw = session.connection().connection.driver_connection
    assert raw is not None  # a checked-out connection has its psycopg connection
    with raw.cursor() as cursor, cursor.copy(COPY_REQUESTS) as copy:
        for row in rows:
            copy.write_row((batch_id, *row))


OUTCOME_COLUMNS = "custom_id, state, status_code, request_id, response_body, error_code, error_message"


def request_outcomes(session: Session, batch_id: str, chunk: int = 1000):
    """Every request of the batch in input-file order, streamed through a server-side cursor in the
    binary protocol (``bytea`` bodies arrive as raw bytes, not hex text: half the bytes on the wire):
    tuples ``(custom_id, state, status_code, request_id, response_body, error_code, error_message)``."""
    raw = session.connection().connection.driver_connection
    assert raw is not None  # a checked-out connection has its psycopg connection
    with raw.cursor(name=f"outcomes_{secrets.token_hex(4)}", binary=True) as cursor:
        cursor.itersize = chunk
        cursor.execute(f"SELECT {OUTCOME_COLUMNS} FROM batch_requests WHERE batch_id = %s ORDER BY line",
                       (batch_id,))
        yield from cursor


def succeed_all_requests(session: Session, batch_id: str, body: bytes) -> None:
    """Give every request of the batch a 200 answer with ``body`` and count them completed: the
    ingest benchmark's stand-in for collecting real results before it times finalisation."""
    session.execute(text("UPDATE batch_requests SET state = 'succeeded', status_code = 200, request_id = 'r', "
                         "response_body = :body WHERE batch_id = :id"), {"body": body, "id": batch_id})
    session.execute(text("UPDATE batches SET request_completed = request_total WHERE id = :id"), {"id": batch_id})

"""The batch state machine: batch statuses (OpenAI's), request states, which change may follow
which, and the finalize decision, as one pure function.

Statuses are :class:`enum.StrEnum` members, so they compare equal to (and are stored as) their
strings. A batch moves::

    validating ──► in_progress ──► finalizing ──► completed
        │  │            │  │
        │  │            │  └──► cancelling ──► cancelled
        │  │            └──► cancelled (nothing handed out yet)
        │  └──► failed (validation)
        └──► cancelled
    validating, in_progress, cancelling ──► expired (past the deadline)

A request moves ``pending`` (in Postgres) → ``queued`` (leased to the processors) → one of
``succeeded``, ``failed``, ``cancelled``, ``expired``, or back to ``pending`` (a retryable failure or
a lapsed lease whose message is gone). ``batch_gateway.store.queries`` makes each change one compare-and-set.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class BatchStatus(StrEnum):
    """A batch's ``status`` (OpenAI's eight values)."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class RequestState(StrEnum):
    """A batch request's ``state``."""

    PENDING = "pending"
    QUEUED = "queued"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


ACTIVE_BATCH_STATUSES: tuple[BatchStatus, ...] = (
    BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)
"""Batches that have not ended; they hold their enqueued tokens against the tenant's quota."""

TERMINAL_BATCH_STATUSES: tuple[BatchStatus, ...] = (
    BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)
"""Batches that have ended: no status change follows."""

EXPIRABLE_STATUSES: tuple[BatchStatus, ...] = (
    BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)
"""Batches that expire at their deadline (a ``finalizing`` batch finishes its files instead)."""

CANCELLABLE_STATUSES: tuple[BatchStatus, ...] = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
"""Batches a cancel acts on; ``cancelling`` and ``cancelled`` answer it unchanged, others refuse."""

OPEN_REQUEST_STATES: tuple[RequestState, ...] = (RequestState.PENDING, RequestState.QUEUED)
"""Requests not yet ended: ``pending`` (in Postgres, not yet fed to the queue) and ``queued``
(handed to the processors, no result yet). No other non-terminal state exists."""

TERMINAL_REQUEST_STATES: tuple[RequestState, ...] = (
    RequestState.SUCCEEDED, RequestState.FAILED, RequestState.CANCELLED, RequestState.EXPIRED)
"""Requests that have ended; each counts once in the batch's ``request_counts``."""

BATCH_TRANSITIONS: Mapping[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset({BatchStatus.IN_PROGRESS, BatchStatus.FAILED, BatchStatus.CANCELLED,
                                       BatchStatus.EXPIRED}),
    BatchStatus.IN_PROGRESS: frozenset({BatchStatus.FINALIZING, BatchStatus.CANCELLING, BatchStatus.CANCELLED,
                                        BatchStatus.EXPIRED}),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED, BatchStatus.EXPIRED}),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}
"""The status changes the lifecycle makes: ``BATCH_TRANSITIONS[from]`` is every status that may
follow ``from`` (none after a terminal status)."""


def can_transition(from_: BatchStatus, to: BatchStatus) -> bool:
    """Whether a batch in ``from_`` may move to ``to`` (:data:`BATCH_TRANSITIONS`)."""
    return to in BATCH_TRANSITIONS[from_]


def finalize_target(status: BatchStatus, *, past_deadline: bool, finished: int, total: int) -> BatchStatus | None:
    """The terminal status a batch in ``status`` is due to reach now, or None when it is not due.

    ``past_deadline``: the database's now is at or past the batch's deadline; ``finished``: its
    requests counted completed or failed; ``total``: its requests. An expirable batch past its
    deadline → ``expired``; ``cancelling`` → ``cancelled`` (once nothing is queued, which the caller
    checks after ending the pending requests); ``in_progress`` with every request finished, or
    ``finalizing`` (a finalisation that died) → ``completed``; anything else (``validating`` in
    time, ``in_progress`` with work left, a terminal status) → None.
    ``queries.batches_to_finalize`` selects the candidates with the same sets.
    """
    if status in TERMINAL_BATCH_STATUSES:
        return None
    if past_deadline and status in EXPIRABLE_STATUSES:
        return BatchStatus.EXPIRED
    if status == BatchStatus.CANCELLING:
        return BatchStatus.CANCELLED
    if status == BatchStatus.IN_PROGRESS:
        return BatchStatus.COMPLETED if finished >= total else None
    if status == BatchStatus.FINALIZING:
        return BatchStatus.COMPLETED
    return None


class ResponseStatus(StrEnum):
    """A background response's ``status`` (OpenAI's Response object: ``queued`` → ``in_progress`` →
    ``completed`` | ``failed`` | ``cancelled`` | ``incomplete``)."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INCOMPLETE = "incomplete"


OPEN_RESPONSE_STATUSES: tuple[ResponseStatus, ...] = (ResponseStatus.QUEUED, ResponseStatus.IN_PROGRESS)
"""Background responses that have not ended: cancellable, and a result may still end them."""

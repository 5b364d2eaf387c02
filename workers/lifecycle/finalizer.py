"""The finalize step: end a batch when :func:`batch_gateway.store.states.finalize_target` says it
is due: ``completed`` when every request is terminal, ``cancelled`` after a cancel, ``expired`` past
the deadline (unfinished requests become ``batch_expired`` / ``batch_cancelled`` lines).

Files are built from the rows, checked against the counts and published with one state change; ids
are derived from the batch id, so a re-run after a crash writes the same files.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from batch_gateway.store import queries
from batch_gateway.store.files import storage_key
from batch_gateway.store.models import Batch
from batch_gateway.store.states import (
    ACTIVE_BATCH_STATUSES,
    OPEN_REQUEST_STATES,
    TERMINAL_BATCH_STATUSES,
    BatchStatus,
    RequestState,
    finalize_target,
)
from workers.context import WorkerContext
from workers.output import RequestOutcome, render_line

log = logging.getLogger(__name__)

FILE_KINDS = ("output", "errors")
"""A batch's two files: 2xx lines go to ``output``, every other line to ``errors``."""


@dataclass(frozen=True, slots=True)
class OutputFile:
    """One written file of a batch: its id and store key, ``lines``, ``size`` (bytes), ``sha256`` (hex)."""

    file_id: str
    key: str
    lines: int
    size: int
    sha256: str


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's ``output`` or ``errors`` file, derived from the batch id."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


class _FileTally:
    """Lines, bytes and SHA-256 of one file being written."""

    __slots__ = ("lines", "size", "hash")

    def __init__(self) -> None:
        self.lines = 0
        self.size = 0
        self.hash = hashlib.sha256()

    def add(self, line: bytes) -> None:
        self.lines += 1
        self.size += len(line)
        self.hash.update(line)


def _write_files(ctx: WorkerContext, batch: Batch) -> dict[str, OutputFile]:
    """Build both files from the rows; returns the non-empty ones by kind (``output``,
    ``errors``). Raises ``RuntimeError`` when a line count disagrees with the rows."""
    kinds = {kind: output_file_id(batch.id, kind) for kind in FILE_KINDS}
    uploads = {kind: ctx.store.begin(storage_key(file_id)) for kind, file_id in kinds.items()}
    tallies = {kind: _FileTally() for kind in kinds}
    succeeded = total = 0
    try:
        with ctx.session() as session:
            for custom_id, _, status_code, request_id, body, error_code, error_message in \
                    queries.request_outcomes(session, batch.id):
                total += 1
                outcome = RequestOutcome(custom_id, status_code, request_id, body, error_code, error_message)
                kind = "output" if outcome.succeeded else "errors"
                succeeded += outcome.succeeded
                line = render_line(batch.id, outcome, endpoint=batch.endpoint, model=batch.model)
                uploads[kind].write(line)
                tallies[kind].add(line)
        if (tallies["output"].lines, tallies["errors"].lines) != (succeeded, total - succeeded) \
                or total != batch.request_total:
            raise RuntimeError(f"batch {batch.id}: line counts do not match its {batch.request_total} requests")
        done = {}
        for kind, upload in uploads.items():
            tally = tallies[kind]
            if tally.lines:
                upload.commit()
                done[kind] = OutputFile(kinds[kind], storage_key(kinds[kind]), tally.lines, tally.size,
                                        tally.hash.hexdigest())
            else:
                upload.abort()
        return done
    except BaseException:
        for upload in uploads.values():
            upload.abort()
        raise


def finalize(ctx: WorkerContext, batch_id: str) -> str:
    """End the batch if it is due (see the module docstring); returns its status afterwards
    (``"missing"`` for no such batch)."""
    with ctx.session() as session:
        batch = queries.lock_batch(session, batch_id)
        if batch is None:
            return "missing"
        if batch.status in TERMINAL_BATCH_STATUSES:
            return batch.status
        target = finalize_target(BatchStatus(batch.status), past_deadline=queries.past_deadline(session, batch),
                                 finished=batch.request_completed + batch.request_failed,
                                 total=batch.request_total)
        if target is None:  # validating (validation decides) or in_progress with work left
            return batch.status
        if target == BatchStatus.EXPIRED:
            queries.end_open_requests(session, batch_id, OPEN_REQUEST_STATES, RequestState.EXPIRED, "batch_expired")
        elif target == BatchStatus.CANCELLED:
            queries.end_open_requests(session, batch_id, (RequestState.PENDING,), RequestState.CANCELLED,
                                      "batch_cancelled")
            if queries.count_requests(session, batch_id, RequestState.QUEUED):
                session.commit()
                return batch.status  # requests in flight: their results or the sweeper end them
        elif batch.status == BatchStatus.IN_PROGRESS:
            queries.transition(session, batch_id, (BatchStatus.IN_PROGRESS,), BatchStatus.FINALIZING)
        session.commit()

    with ctx.session() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None  # locked above; batches are never deleted while they run
        tenant = batch.tenant_id
        files = _write_files(ctx, batch)
        ttl = (batch.output_expires_after or {}).get("seconds", 30 * 24 * 3600)
        for kind, file in files.items():
            queries.upsert_output_file(session, file_id=file.file_id, tenant_id=batch.tenant_id, size=file.size,
                                       filename=f"{batch.id}_{kind}.jsonl", storage_key=file.key,
                                       sha256=file.sha256, expires_after_seconds=ttl)
        output, errors = files.get("output"), files.get("errors")
        completed = output.lines if output else 0
        failed = errors.lines if errors else 0
        # any active status: a re-run after a crash finds the batch where the first run left it
        moved = queries.transition(
            session, batch_id, ACTIVE_BATCH_STATUSES, target,
            output_file_id=output.file_id if output else None,
            error_file_id=errors.file_id if errors else None,
            request_completed=completed, request_failed=failed,
        )
        session.commit()
        status = moved.status if moved else batch.status
    if moved is not None:
        ctx.metrics.finalized.labels(status).inc()
        ctx.metrics.finalized_requests.labels("output").inc(completed)
        ctx.metrics.finalized_requests.labels("errors").inc(failed)
    log.info("batch finalized", extra={"action": f"batch_{status}", "batch_id": batch_id, "tenant": tenant,
                                       "completed": completed, "failed": failed})
    return status


def cancel(ctx: WorkerContext, batch_id: str) -> str:
    """Act on a cancel at once: mark the batch for the processors (its queued messages are answered
    ``CANCELLED`` instead of run) and end what is not queued; returns the batch's status."""
    ctx.queue.mark_cancelled(batch_id)
    log.info("batch cancel marked", extra={"action": "cancel", "batch_id": batch_id})
    return finalize(ctx, batch_id)


def finalize_due(ctx: WorkerContext) -> list[str]:
    """Finalize every batch that is due; returns the ids that reached a terminal state."""
    with ctx.session() as session:
        due = queries.batches_to_finalize(session)
    return [batch_id for batch_id in due if finalize(ctx, batch_id) in TERMINAL_BATCH_STATUSES]

"""The batch state machine (``batch_gateway.store.states``), no database."""

from __future__ import annotations

import pytest

from batch_gateway.store.states import (
    ACTIVE_BATCH_STATUSES,
    BATCH_TRANSITIONS,
    EXPIRABLE_STATUSES,
    OPEN_REQUEST_STATES,
    TERMINAL_BATCH_STATUSES,
    TERMINAL_REQUEST_STATES,
    BatchStatus,
    RequestState,
    can_transition,
    finalize_target,
)

S = BatchStatus


def test_statuses_are_openai_strings():
    assert [s.value for s in BatchStatus] == ["validating", "failed", "in_progress", "finalizing", "completed",
                                               "expired", "cancelling", "cancelled"]
    assert BatchStatus.IN_PROGRESS == "in_progress" and f"batch.{BatchStatus.CANCELLED}" == "batch.cancelled"
    assert {s.value for s in RequestState} == {"pending", "queued", "succeeded", "failed", "cancelled", "expired"}


def test_state_sets_split_every_state_once():
    assert set(ACTIVE_BATCH_STATUSES) | set(TERMINAL_BATCH_STATUSES) == set(BatchStatus)
    assert not set(ACTIVE_BATCH_STATUSES) & set(TERMINAL_BATCH_STATUSES)
    assert set(OPEN_REQUEST_STATES) | set(TERMINAL_REQUEST_STATES) == set(RequestState)
    assert not set(OPEN_REQUEST_STATES) & set(TERMINAL_REQUEST_STATES)
    assert set(EXPIRABLE_STATUSES) == set(ACTIVE_BATCH_STATUSES) - {S.FINALIZING}


def test_legal_transitions():
    assert set(BATCH_TRANSITIONS) == set(BatchStatus)
    for status in TERMINAL_BATCH_STATUSES:
        assert not BATCH_TRANSITIONS[status]
    assert can_transition(S.VALIDATING, S.IN_PROGRESS) and can_transition(S.VALIDATING, S.FAILED)
    assert can_transition(S.IN_PROGRESS, S.FINALIZING) and can_transition(S.FINALIZING, S.COMPLETED)
    assert can_transition(S.IN_PROGRESS, S.CANCELLING) and can_transition(S.CANCELLING, S.CANCELLED)
    assert can_transition(S.CANCELLING, S.EXPIRED)
    assert not can_transition(S.VALIDATING, S.COMPLETED)  # only through in_progress and finalizing
    assert not can_transition(S.FINALIZING, S.EXPIRED)  # a finalisation finishes its files
    assert not can_transition(S.IN_PROGRESS, S.FAILED)  # only validation fails a batch
    assert not can_transition(S.COMPLETED, S.CANCELLED)
    for status in BatchStatus:
        assert not can_transition(status, S.VALIDATING)


@pytest.mark.parametrize(("status", "past", "finished", "total", "target"), [
    (S.VALIDATING, False, 0, 0, None),  # validation decides
    (S.VALIDATING, True, 0, 0, S.EXPIRED),
    (S.IN_PROGRESS, False, 2, 3, None),  # work left
    (S.IN_PROGRESS, False, 3, 3, S.COMPLETED),
    (S.IN_PROGRESS, True, 3, 3, S.EXPIRED),  # the deadline wins over completion
    (S.IN_PROGRESS, True, 0, 3, S.EXPIRED),
    (S.CANCELLING, False, 0, 3, S.CANCELLED),
    (S.CANCELLING, True, 0, 3, S.EXPIRED),
    (S.FINALIZING, False, 3, 3, S.COMPLETED),
    (S.FINALIZING, True, 3, 3, S.COMPLETED),  # never expires once finalizing
    (S.COMPLETED, False, 3, 3, None),
    (S.EXPIRED, True, 0, 3, None),
    (S.FAILED, True, 0, 0, None),
    (S.CANCELLED, False, 0, 0, None),
])
def test_finalize_target(status, past, finished, total, target):
    assert finalize_target(status, past_deadline=past, finished=finished, total=total) == target


def test_every_finalize_target_is_a_legal_step_from_where_the_batch_is():
    for status in BatchStatus:
        for past in (False, True):
            target = finalize_target(status, past_deadline=past, finished=1, total=1)
            if target is None:
                continue
            # in_progress completes through finalizing
            step = S.FINALIZING if (status, target) == (S.IN_PROGRESS, S.COMPLETED) else target
            assert can_transition(status, step), (status, target)

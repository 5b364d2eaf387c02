"""The processor's hooks: every event it counts or logs goes through one :class:`ProcessorObserver`
(:class:`~async_processor.metrics.ProcessorMetrics` is the one the services use), so the pump's
control flow carries no bookkeeping of its own.

The observer keeps the only books: its Prometheus series and ``counts``, the tally of outcomes
(``success``, ``http_error``, ``inference_error``, ``retried``, ``held_saturated``, ``deadline_exceeded``, ``invalid``,
``dead_lettered``, ``duplicate``, ``handed_back``, ``cancelled``, ``taken_over``) that ``backfill processor`` logs
at stop and :attr:`Processor.counts <async_processor.processor.Processor.counts>` reads.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

from async_processor.gates import Gate
from async_processor.lanes import LaneBuffer, Work
from common.contracts.queue import ResultMessage


class Shed(enum.StrEnum):
    """Why a request ended without (another) dispatch (the ``reason`` of ``backfill_processor_shed``)."""

    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    DEAD_LETTERED = "dead_lettered"
    INVALID = "invalid"


def outcome_of(status: int) -> str:
    """Tally key of a final router answer: ``success`` (< 400), ``http_error`` (>= 400) or
    ``inference_error`` (0: no answer at all)."""
    if not status:
        return "inference_error"
    return "success" if status < 400 else "http_error"


class Observed(Protocol):
    """What an observer reads of the processor it watches (at scrape time)."""

    @property
    def buffer(self) -> LaneBuffer:
        """The lane buffer: held work per lane."""
        ...

    @property
    def in_flight(self) -> Mapping[Work, Any]:
        """Work whose HTTP attempt runs now."""
        ...

    @property
    def gate(self) -> Gate:
        """The gate work passes before dispatch."""
        ...

    def health(self) -> tuple[bool, str]:
        """Whether it consumes now, and why not (see :meth:`Processor.health
        <async_processor.processor.Processor.health>`)."""
        ...


class ProcessorObserver(Protocol):
    """What a :class:`~async_processor.processor.Processor` reports, as it happens. ``lane`` is
    the lane the message came from; statuses are HTTP statuses, 0 for no answer."""

    counts: Counter[str]
    """The tally of outcomes (see the module docstring)."""

    def watch(self, processor: Observed) -> None:
        """``processor`` reports here from now on (scrape-time readings of its buffer and gates)."""
        ...

    def dispatched(self, work: Work) -> None:
        """A POST of ``work`` starts: its first send (``work.sends`` 1) or a re-send (a retry, or
        again after the router's fast refusal)."""
        ...

    def attempt_finished(self, lane: str, status: int, seconds: float) -> None:
        """An attempt ended after ``seconds`` with ``status``."""
        ...

    def answered(self, lane: str, status: int) -> None:
        """A request ends with the router's last answer ``status`` (see :func:`outcome_of`)."""
        ...

    def retried(self, lane: str, status: int) -> None:
        """An attempt answered ``status`` goes back with a backoff."""
        ...

    def held_saturated(self, lane: str) -> None:
        """The router refused an attempt at once as saturated (429 ``rejected-saturated``): the
        request is held for its ``Retry-After``, no attempt counted."""
        ...

    def shed(self, lane: str, reason: Shed) -> None:
        """A request ends without (another) dispatch for ``reason``."""
        ...

    def duplicate(self, lane: str) -> None:
        """A redelivered message of an id already finished is acknowledged without a result."""
        ...

    def handed_back(self, count: int) -> None:
        """``count`` messages go back to the queue unfinished (claimed elsewhere, or at stop)."""
        ...

    def result(self, lane: str, result: ResultMessage) -> None:
        """A terminal result is handed to the settler for publishing."""
        ...

    def taken_over(self, work: Work, stage: str) -> None:
        """Held ``work`` is dropped: its claim was lost to another processor (this one stalled past
        its lease). ``stage``: ``held`` (before dispatch), ``in_flight`` (attempt cancelled) or
        ``result`` (its result not published)."""
        ...

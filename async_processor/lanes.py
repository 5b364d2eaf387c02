"""Priority lanes: the bounded in-memory buffer between the queue and the dispatcher.

Lanes are objectives (:data:`~common.contracts.queue.LANE_PRIORITIES`: ``interactive`` 100,
``async`` 10, ``batch`` -10) served in strict priority order: a lower lane dispatches only when every
higher lane is empty, waiting out a retry backoff, or refused by a gate (e.g. a tenant quota).
Inside a lane, earliest deadline first; ties in arrival order (FIFO).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from async_processor.backends.base import Delivery
from common.contracts.queue import LANE_PRIORITIES, RequestMessage


@dataclass(eq=False)
class Work:
    """One admitted request held by the processor.

    ``attempts``: HTTP attempts made so far. ``not_before``: monotonic seconds before which it is not
    dispatched (retry backoff). ``last_status`` / ``last_body``: the last retryable HTTP answer, given
    back as the result if the deadline ends the retries. ``gated_by``: the kind of the gate holding
    it back now ("" when none), so :class:`~async_processor.gates.AllGates` counts a deny once.
    ``taken_over``: its claim was found lost to another processor; it is dropped, never finished.
    """

    request: RequestMessage
    delivery: Delivery
    lane: str
    seq: int = 0
    attempts: int = 0
    not_before: float = 0.0
    last_status: int = 0
    last_body: bytes = b""
    gated_by: str = ""
    taken_over: bool = False
    body: bytes = field(default=b"", repr=False)

    @property
    def priority(self) -> int:
        """The lane's priority band."""
        return LANE_PRIORITIES.get(self.lane, 0)

    @property
    def tenant(self) -> str:
        """The request's tenant (``metadata["tenant"]``, may be empty)."""
        return self.request.metadata.get("tenant", "")


def _key(work: Work) -> tuple[int, int]:
    return (work.request.deadline, work.seq)


class LaneBuffer:
    """Held work per lane, sorted by (deadline, arrival).

    ``capacity``: how many items the reader may fill it to (:meth:`free`); :meth:`push` always
    accepts, so work coming back from a retry is never dropped. Raises ``ValueError`` for an unknown
    lane name.
    """

    def __init__(self, lanes: Sequence[str], capacity: int):
        unknown = [lane for lane in lanes if lane not in LANE_PRIORITIES]
        if unknown:
            raise ValueError(f"unknown lanes {unknown}")
        self.order = sorted(lanes, key=lambda lane: -LANE_PRIORITIES[lane])
        self.capacity = capacity
        self._lanes: dict[str, list[Work]] = {lane: [] for lane in self.order}
        self._seq = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Work]:
        for items in self._lanes.values():
            yield from items

    def depth(self, lane: str) -> int:
        """Items held in ``lane`` (0 for a lane not read)."""
        return len(self._lanes.get(lane, ()))

    def free(self) -> int:
        """How many more items the reader may take from the queue now (>= 0)."""
        return max(0, self.capacity - self._size)

    def push(self, work: Work) -> None:
        """Insert by (deadline, arrival); a retried item keeps its first arrival number."""
        if not work.seq:
            work.seq = next(self._seq) + 1
        bisect.insort(self._lanes[work.lane], work, key=_key)
        self._size += 1

    def pop(self, now: float, admits: Callable[[Work], bool]) -> Work | None:
        """The first item, in lane priority then (deadline, arrival) order, whose ``not_before`` is
        reached (``now``: monotonic seconds) and that ``admits`` accepts; None if there is none."""
        for lane in self.order:
            items = self._lanes[lane]
            for i, work in enumerate(items):
                if work.not_before <= now and admits(work):
                    del items[i]
                    self._size -= 1
                    return work
        return None

    def expired(self, now_unix: float) -> list[Work]:
        """Remove and return items whose deadline (Unix seconds) is at or before ``now_unix``."""
        out: list[Work] = []
        for lane, items in self._lanes.items():
            keep = [w for w in items if w.request.deadline > now_unix]
            if len(keep) != len(items):
                out.extend(w for w in items if w.request.deadline <= now_unix)
                self._lanes[lane] = keep
        self._size -= len(out)
        return out

    def remove_batches(self, batch_ids: set[str]) -> list[Work]:
        """Remove and return held items whose ``metadata.batch_id`` is in ``batch_ids``."""
        out: list[Work] = []
        for lane, items in self._lanes.items():
            keep = [w for w in items if w.request.metadata.get("batch_id") not in batch_ids]
            if len(keep) != len(items):
                out.extend(w for w in items if w.request.metadata.get("batch_id") in batch_ids)
                self._lanes[lane] = keep
        self._size -= len(out)
        return out

    def remove(self, works: Sequence[Work]) -> list[Work]:
        """Remove and return those of ``works`` held here."""
        wanted = {id(w) for w in works}
        out: list[Work] = []
        for lane, items in self._lanes.items():
            keep = [w for w in items if id(w) not in wanted]
            if len(keep) != len(items):
                out.extend(w for w in items if id(w) in wanted)
                self._lanes[lane] = keep
        self._size -= len(out)
        return out

    def next_ready_at(self, now: float) -> float | None:
        """Smallest ``not_before`` still in the future (monotonic seconds), or None."""
        times = [w.not_before for w in self if w.not_before > now]
        return min(times) if times else None

    def drain(self) -> list[Work]:
        """Remove and return everything."""
        out = list(self)
        for lane in self._lanes:
            self._lanes[lane] = []
        self._size = 0
        return out

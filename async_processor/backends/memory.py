"""In-memory queue backend: the same leases, redelivery, delivery counts and dead-lettering as the
real transports, inside one process (unit tests, single-process mode, ``--backend memory``); and its
producer side (:class:`MemoryLaneProducer`, :class:`MemoryResultQueue`) over the same lanes and
results."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from async_processor.backends.base import Admission, ClaimTable, Delivery, LaneDepth, ResultEntry
from common.contracts.queue import (
    DEFAULT_RESULT_STREAM,
    RequestMessage,
    ResultMessage,
    encode_request,
)


@dataclass(eq=False)
class _Entry:
    seq: int
    body: bytes
    deliveries: int = 0
    visible_at: float = 0.0  # deliverable when now >= visible_at


@dataclass(eq=False)
class _Group:
    """A consumer group on one result list: ``next`` the first index never handed out, ``pending``
    index -> (consumer, when handed out)."""

    next: int = 0
    pending: dict[int, tuple[str, float]] = field(default_factory=dict)


class MemoryBackend:
    """Lanes as ordered dicts of entries; results as lists per queue name.

    ``clock``: monotonic seconds (default ``time.monotonic``). ``dead``: lane -> list of
    ``(body, reason)``. ``results``: queue name -> list of results ("" maps to
    :data:`~common.contracts.queue.DEFAULT_RESULT_STREAM`). :meth:`cancel` sets a cancel marker.
    """

    name = "memory"

    def __init__(self, done_ttl_s: float = 86400.0, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.lanes: dict[str, dict[int, _Entry]] = {}
        self.dead: dict[str, list[tuple[bytes, str]]] = {}
        self.results: dict[str, list[ResultMessage]] = {}
        self.claims = ClaimTable(done_ttl_s, clock)
        self.groups: dict[tuple[str, str], _Group] = {}
        self._seq = itertools.count(1)
        self._result_event = asyncio.Event()

    async def start(self) -> None:
        """Nothing to create."""

    async def close(self) -> None:
        """Nothing to close; held messages come back after their lease."""

    def cancel(self, batch_id: str) -> None:
        """Set the cancel marker of ``batch_id``."""
        self.claims.cancelled.add(batch_id)

    async def receive(self, lane: str, max_messages: int, lease_s: float) -> list[Delivery]:
        """Oldest deliverable entries first (new ones and lapsed leases alike)."""
        now = self.clock()
        out: list[Delivery] = []
        for entry in self.lanes.get(lane, {}).values():
            if len(out) >= max_messages:
                break
            if entry.visible_at <= now:
                entry.deliveries += 1
                entry.visible_at = now + lease_s
                out.append(Delivery(lane, entry.body, entry.deliveries, str(entry.seq), handle=entry))
        return out

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Remove the entries."""
        for d in deliveries:
            self.lanes.get(d.lane, {}).pop(d.handle.seq, None)

    async def nack(self, deliveries: Sequence[Delivery], delay_s: float = 0.0) -> None:
        """Visible again after ``delay_s``."""
        for d in deliveries:
            d.handle.visible_at = self.clock() + delay_s

    def _held(self, d: Delivery) -> bool:
        entry: _Entry = d.handle
        return self.lanes.get(d.lane, {}).get(entry.seq) is entry and entry.deliveries == d.delivery_count

    async def extend(self, deliveries: Sequence[Delivery], lease_s: float) -> list[Delivery]:
        """Visible again only after ``lease_s`` from now; claims follow. Lost: entries acknowledged
        or delivered again since this delivery."""
        lost = [d for d in deliveries if not self._held(d)]
        kept = [d for d in deliveries if d not in lost]
        for d in kept:
            d.handle.visible_at = self.clock() + lease_s
        self.claims.extend([d.request_id for d in kept if d.request_id], lease_s)
        return lost

    async def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> None:
        """Append to ``dead[lane]`` and remove."""
        for d in deliveries:
            self.dead.setdefault(d.lane, []).append((d.body, reason))
        await self.ack(deliveries)

    async def publish_results(self, results: Sequence[tuple[ResultMessage, str]]) -> list[bool]:
        """Append to ``results[name]``; the ids are done (a result of an id done already is refused)."""
        published = self.claims.finish([result.id for result, _ in results])
        for (result, queue), ok in zip(results, published):
            if ok:
                self.results.setdefault(queue or DEFAULT_RESULT_STREAM, []).append(result)
        self._result_event.set()
        return published

    async def publish_request(self, lane: str, message: RequestMessage | bytes) -> str:
        """Append a new entry; returns its sequence number as a string."""
        body = message if isinstance(message, bytes) else encode_request(message)
        entry = _Entry(next(self._seq), body)
        self.lanes.setdefault(lane, {})[entry.seq] = entry
        return str(entry.seq)

    async def admit(self, requests: Sequence[RequestMessage], lease_s: float) -> list[Admission]:
        """See :class:`~async_processor.backends.base.ClaimTable`."""
        return self.claims.admit(requests, lease_s)

    async def cancelled_batches(self, batch_ids: Sequence[str]) -> set[str]:
        """See :meth:`QueueBackend.cancelled_batches` (markers set with :meth:`cancel`)."""
        return self.claims.cancelled_among(batch_ids)

    async def cancelled_requests(self, requests: Sequence[RequestMessage]) -> set[str]:
        """None: llm-d-async's cancel keys live in Redis only."""
        return set()

    async def release(self, ids: Sequence[str]) -> None:
        """Drop running claims."""
        self.claims.release(ids)

    def result_reader(self, queue_name: str = "") -> _MemoryResultReader:
        """A reader from the start of ``results[queue_name]``."""
        return _MemoryResultReader(self, queue_name or DEFAULT_RESULT_STREAM)

    def lane_producer(self) -> MemoryLaneProducer:
        """The producer side of these lanes (synchronous)."""
        return MemoryLaneProducer(self)

    def result_queue(self, queue_name: str, *, group: str, consumer: str,
                     reclaim_idle_s: float = 60.0) -> MemoryResultQueue:
        """``results[queue_name]`` read by ``consumer`` of ``group`` (synchronous)."""
        return MemoryResultQueue(self, queue_name or DEFAULT_RESULT_STREAM, group=group, consumer=consumer,
                                 reclaim_idle_s=reclaim_idle_s)


class MemoryLaneProducer:
    """:class:`~async_processor.backends.base.LaneProducer` over a :class:`MemoryBackend`'s lanes."""

    def __init__(self, backend: MemoryBackend):
        self.backend = backend

    def publish(self, lane: str, messages: Sequence[RequestMessage]) -> None:
        """Append an entry per message."""
        for message in messages:
            entry = _Entry(next(self.backend._seq), encode_request(message))
            self.backend.lanes.setdefault(lane, {})[entry.seq] = entry

    def mark_cancelled(self, batch_id: str, ttl_s: int) -> None:
        """:meth:`MemoryBackend.cancel` (markers never expire in memory)."""
        self.backend.cancel(batch_id)

    def lane_depths(self, lanes: Sequence[str], group: str) -> list[LaneDepth]:
        """Entries not acknowledged, those held under a lease now, dead letters (one group only)."""
        now = self.backend.clock()
        out = []
        for lane in lanes:
            entries = self.backend.lanes.get(lane, {}).values()
            out.append(LaneDepth(lane=lane, queue=lane, length=len(entries),
                                 pending=sum(1 for e in entries if e.deliveries and e.visible_at > now),
                                 dead=len(self.backend.dead.get(lane, []))))
        return out


class MemoryResultQueue:
    """:class:`~async_processor.backends.base.ResultQueue` over ``results[queue]`` of a
    :class:`MemoryBackend`; entry ids are list indexes (as ASCII bytes)."""

    def __init__(self, backend: MemoryBackend, queue: str, *, group: str, consumer: str, reclaim_idle_s: float):
        self.backend, self.queue, self.consumer, self.reclaim_idle_s = backend, queue, consumer, reclaim_idle_s
        self.group = backend.groups.setdefault((queue, group), _Group())

    def read(self, count: int) -> list[ResultEntry]:
        """Entries pending longer than ``reclaim_idle_s`` (any consumer's), then new ones."""
        now = self.backend.clock()
        results = self.backend.results.get(self.queue, [])
        taken = [index for index, (_, at) in sorted(self.group.pending.items())
                 if now - at >= self.reclaim_idle_s][:count]
        while len(taken) < count and self.group.next < len(results):
            taken.append(self.group.next)
            self.group.next += 1
        for index in taken:
            self.group.pending[index] = (self.consumer, now)
        return [(str(index).encode(), results[index]) for index in taken]

    def ack(self, entry_ids: Sequence[bytes]) -> None:
        """Drop the entries from the group's pending list."""
        for entry_id in entry_ids:
            self.group.pending.pop(int(entry_id), None)


class _MemoryResultReader:
    def __init__(self, backend: MemoryBackend, queue: str):
        self.backend, self.queue, self.offset = backend, queue, 0

    async def read(self, timeout_s: float) -> list[ResultMessage]:
        loop_deadline = time.monotonic() + timeout_s
        while True:
            found = self.backend.results.get(self.queue, [])[self.offset:]
            if found or time.monotonic() >= loop_deadline:
                self.offset += len(found)
                return list(found)
            self.backend._result_event.clear()
            try:
                await asyncio.wait_for(self.backend._result_event.wait(), loop_deadline - time.monotonic())
            except TimeoutError:
                pass

    async def close(self) -> None:
        return None

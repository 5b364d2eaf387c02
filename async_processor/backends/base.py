"""The queue port: the protocol every queue backend implements for the processor
(:class:`QueueBackend`, asynchronous), the producer side a synchronous caller (the batch workers,
the dashboard) uses (:class:`LaneProducer`, :class:`ResultQueue`), and the small pieces they share.

Semantics every backend keeps (the contract suite ``tests/contract/test_queue_backends.py`` checks
them on memory, Redis Streams, the Pub/Sub emulator and the Pub/Sub fake):

- **At-least-once with leases.** :meth:`QueueBackend.receive` hands out messages under a lease of
  ``lease_s`` seconds. A message neither acknowledged nor extended within its lease is delivered again
  (to any consumer) with ``delivery_count`` one higher. ``delivery_count`` is 1 on first delivery.
- **Ack after publish.** The processor calls :meth:`publish_results` and only then :meth:`ack`.
- **Hand back.** :meth:`nack` makes a message deliverable again after ``delay_s`` (0 = now).
- **Dead letter.** :meth:`dead_letter` moves a message to the lane's dead-letter queue and acks it.
- **Dedup by id.** :meth:`admit` claims request ids before dispatch: ``NEW`` (claimed, run it),
  ``RUNNING`` (claimed elsewhere and not lapsed: hand it back), ``DONE`` (a result was published:
  just ack), ``CANCELLED`` (its batch carries a cancel marker, or llm-d-async's cancel key holds
  its ``request_token``). :meth:`publish_results` records
  ``DONE`` for the id of each result it publishes; :meth:`release` drops a claim of a message
  handed back.
- **One result per id.** :meth:`publish_results` refuses (answers False for) a result whose id is done
  already, or (where claims are shared: Redis) claimed by another processor; :meth:`extend` answers
  the deliveries whose claim or lease was lost (another processor may hold them now): the processor
  drops that work instead of running it or publishing its result.

Producer side (``tests/contract/test_producer_queues.py`` checks it on memory and Redis Streams):

- :meth:`LaneProducer.publish` puts request messages on a lane; :meth:`LaneProducer.mark_cancelled`
  sets the cancel marker :meth:`QueueBackend.admit` and :meth:`QueueBackend.cancelled_batches` see;
  :meth:`LaneProducer.lane_depths` reports each lane's backlog for the dashboard.
- :class:`TrackedLaneProducer` (Redis Streams) also returns the transport ids of what it publishes
  and says, read-only, where each such message is now (:class:`Whereabouts`: waiting, held,
  answered or gone), so a producer re-publishes only what is really lost.
- :class:`ResultQueue` reads one result queue through a consumer group: each entry goes to one
  consumer of the group and stays pending until :meth:`ResultQueue.ack`; an entry left pending longer
  than ``reclaim_idle_s`` (its consumer died) is handed to the next reader of the group.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.contracts.queue import RequestMessage, ResultMessage


class Admission(enum.Enum):
    """Answer of :meth:`QueueBackend.admit` for one request id."""

    NEW = "new"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Delivery:
    """One delivery of one message.

    ``lane``: the lane it came from. ``body``: the raw message bytes. ``delivery_count``: 1 on the
    first delivery. ``transport_id``: the backend's id (stream entry id, Pub/Sub message id).
    ``handle``: backend-private (ack id, entry). ``received_at``: ``time.monotonic()`` at receipt,
    ``extended_at`` the last lease extension. ``request_id``: the decoded message ``id``, set by the
    processor (backends extend its claim with the lease).
    """

    lane: str
    body: bytes
    delivery_count: int
    transport_id: str
    handle: Any = None
    request_id: str = ""
    received_at: float = field(default_factory=time.monotonic)
    extended_at: float = field(default_factory=time.monotonic)


class ResultReader(Protocol):
    """Reads results from one result queue, oldest first (for producers, ``--wait`` and tests)."""

    async def read(self, timeout_s: float) -> list[ResultMessage]:
        """Results that arrived since the last call; waits up to ``timeout_s`` for the first."""
        ...

    async def close(self) -> None:
        """Release what the reader holds (a Pub/Sub reader deletes its subscription)."""
        ...


class QueueBackend(Protocol):
    """A request transport with leases, plus the result queue and the id claims."""

    name: str

    async def start(self) -> None:
        """Create what is missing (streams and consumer group; topics and subscriptions)."""
        ...

    async def close(self) -> None:
        """Close clients. Messages still held are redelivered after their lease."""
        ...

    async def receive(self, lane: str, max_messages: int, lease_s: float) -> list[Delivery]:
        """Up to ``max_messages`` deliveries of ``lane``: lapsed leases first, then new messages.
        Never blocks longer than a short poll. Raises :class:`~async_processor.errors.BackendError`."""
        ...

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Acknowledge: these messages are never delivered again."""
        ...

    async def nack(self, deliveries: Sequence[Delivery], delay_s: float = 0.0) -> None:
        """Hand back: deliverable again after ``delay_s`` seconds."""
        ...

    async def extend(self, deliveries: Sequence[Delivery], lease_s: float) -> list[Delivery]:
        """Renew the leases (and the id claims of ``request_id``) to ``lease_s`` seconds from now;
        returns those that are no longer ours (not renewed): the id is done, another processor
        claimed it, or the lease lapsed where the transport can then hand it to anyone."""
        ...

    async def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> None:
        """Move to the lane's dead-letter queue (with ``reason``) and acknowledge."""
        ...

    async def publish_results(self, results: Sequence[tuple[ResultMessage, str]]) -> list[bool]:
        """Publish ``(result, result_queue_name)`` pairs ("" = the default result queue) and record
        each non-empty result id as done (see :meth:`admit`); returns once all are durable in the
        transport, one flag per pair: False where the result was refused (its id is done already, or
        claimed by another processor). Raises ``BackendError`` if any failed."""
        ...

    async def publish_request(self, lane: str, message: RequestMessage | bytes) -> str:
        """Put one request message on ``lane``; returns the transport id."""
        ...

    async def admit(self, requests: Sequence[RequestMessage], lease_s: float) -> list[Admission]:
        """Claim each request id for ``lease_s`` seconds (see module docstring)."""
        ...

    async def release(self, ids: Sequence[str]) -> None:
        """Drop running claims of these ids (they were handed back)."""
        ...

    async def cancelled_requests(self, requests: Sequence[RequestMessage]) -> set[str]:
        """The ids of those ``requests`` carrying llm-d-async's ``request_token`` whose cancel key
        (:func:`~common.contracts.queue.request_cancel_key`) holds that token now (held work of
        theirs is dropped); empty where the transport has no such keys."""
        ...

    async def cancelled_batches(self, batch_ids: Sequence[str]) -> set[str]:
        """Which of these batch ids carry a cancel marker now (held work of theirs is dropped)."""
        ...

    def result_reader(self, queue_name: str = "") -> ResultReader:
        """A reader of ``queue_name`` ("" = the default result queue). Pub/Sub readers see only
        results published after the reader was made."""
        ...


@dataclass(frozen=True)
class LaneDepth:
    """Backlog of one lane: ``queue`` the transport's name for it (a stream, a topic), ``length``
    messages not yet acknowledged, ``pending`` of those delivered to a processor now, ``dead``
    messages in its dead-letter queue."""

    lane: str
    queue: str
    length: int
    pending: int
    dead: int


class LaneProducer(Protocol):
    """The producer side of the request lanes of one pool, synchronous."""

    def publish(self, lane: str, messages: Sequence[RequestMessage]) -> None:
        """Put ``messages`` on ``lane`` (one round trip where the transport allows)."""
        ...

    def mark_cancelled(self, batch_id: str, ttl_s: int) -> None:
        """Set the cancel marker of ``batch_id`` for ``ttl_s`` seconds: processors answer its queued
        messages ``CANCELLED``."""
        ...

    def lane_depths(self, lanes: Sequence[str], group: str) -> list[LaneDepth]:
        """The backlog of each of ``lanes`` as the processors' consumer group ``group`` sees it, in
        the order given."""
        ...


class Whereabouts(enum.Enum):
    """Where a published request message is now (:meth:`TrackedLaneProducer.whereabouts`).

    ``WAITING``: on its lane, not delivered yet. ``HELD``: delivered and not acknowledged (a
    processor holds it and renews its lease, or one will take it over once that lease lapses).
    ``ANSWERED``: its result was published (its id claim is ``done``). ``GONE``: none of these: the
    message was lost (its queue emptied or deleted, the entry removed without a result)."""

    WAITING = "waiting"
    HELD = "held"
    ANSWERED = "answered"
    GONE = "gone"


class TrackedLaneProducer(LaneProducer, Protocol):
    """A :class:`LaneProducer` that can say what became of a message it published (the batch
    sweeper asks before it publishes a request again)."""

    def publish_tracked(self, lane: str, messages: Sequence[RequestMessage]) -> list[str]:
        """:meth:`LaneProducer.publish`, returning the transport id of each message, in order."""
        ...

    def whereabouts(self, lane: str, group: str, messages: Sequence[tuple[str, str]]) -> list[Whereabouts]:
        """Read-only: for each ``(transport_id, request_id)`` published on ``lane`` (``transport_id``
        "" when unknown), where it is now as the processors' consumer group ``group`` sees it, in
        the order given."""
        ...


ResultEntry = tuple[bytes, ResultMessage | None]
"""One entry of a result queue: its transport id (acknowledge it with :meth:`ResultQueue.ack`) and
the result, None for an entry that is not a result message or lost its data."""


class ResultQueue(Protocol):
    """One result queue read through a consumer group, synchronous (see the module docstring)."""

    def read(self, count: int) -> list[ResultEntry]:
        """Up to ``count`` entries: first those another consumer left pending longer than the
        reclaim idle time, then new ones. Never blocks."""
        ...

    def ack(self, entry_ids: Sequence[bytes]) -> None:
        """These entries are handled: never handed out again."""
        ...


class ClaimTable:
    """In-process id claims with expiry, for backends without a shared store (memory, Pub/Sub).

    ``clock``: seconds, monotonic (default ``time.monotonic``). ``done_ttl_s``: how long a finished
    id is remembered. ``cancelled``: batch ids whose messages answer ``CANCELLED``.
    """

    def __init__(self, done_ttl_s: float = 86400.0, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.done_ttl_s = done_ttl_s
        self._claims: dict[str, tuple[str, float]] = {}
        self.cancelled: set[str] = set()

    def admit(self, requests: Sequence[RequestMessage], lease_s: float) -> list[Admission]:
        """See :meth:`QueueBackend.admit`."""
        now = self.clock()
        out = []
        for request in requests:
            state, until = self._claims.get(request.id, ("", 0.0))
            if state == "done" and until > now:
                out.append(Admission.DONE)
            elif request.metadata.get("batch_id") in self.cancelled:
                out.append(Admission.CANCELLED)
            elif state == "running" and until > now:
                out.append(Admission.RUNNING)
            else:
                self._claims[request.id] = ("running", now + lease_s)
                out.append(Admission.NEW)
        if len(self._claims) > 100_000:
            self._claims = {k: v for k, v in self._claims.items() if v[1] > now}
        return out

    def extend(self, ids: Sequence[str], lease_s: float) -> None:
        """Push the expiry of running claims to ``lease_s`` from now (a lapsed one nobody took
        included)."""
        until = self.clock() + lease_s
        for id in ids:
            if self._claims.get(id, ("",))[0] == "running":
                self._claims[id] = ("running", until)

    def finish(self, ids: Sequence[str]) -> list[bool]:
        """Mark done for ``done_ttl_s``; False for an id already done (its result is out: refuse a
        second one), True otherwise ("" ids always True)."""
        now = self.clock()
        out = []
        for id in ids:
            state, until = self._claims.get(id, ("", 0.0)) if id else ("", 0.0)
            if state == "done" and until > now:
                out.append(False)
                continue
            if id:
                self._claims[id] = ("done", now + self.done_ttl_s)
            out.append(True)
        return out

    def forget(self, ids: Sequence[str]) -> None:
        """Forget these ids whatever their state (a publish that marked them done failed)."""
        for id in ids:
            self._claims.pop(id, None)

    def release(self, ids: Sequence[str]) -> None:
        """Forget running claims."""
        for id in ids:
            if self._claims.get(id, ("",))[0] == "running":
                del self._claims[id]

    def cancelled_among(self, batch_ids: Sequence[str]) -> set[str]:
        """The ids among ``batch_ids`` that carry a cancel marker here."""
        return {batch_id for batch_id in batch_ids if batch_id in self.cancelled}

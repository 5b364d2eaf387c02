"""Google Pub/Sub backend, on the real ``google-cloud-pubsub`` client (synchronous pull, run in worker
threads so the event loop never blocks).

Layout in project ``pubsub_project`` (names from :mod:`common.contracts.queue`):

- per lane a topic ``backfill-requests-{pool}-{lane}``, its subscription ``…-processor`` shared by
  every processor, and a dead-letter topic ``…-dead`` (with subscription ``…-dead-reader``, so dead
  letters are kept); the subscription's dead-letter policy sends a message there after
  ``max_deliveries + 2`` attempts (clamped to Pub/Sub's 5–100) as a backstop — the processor itself
  dead-letters after ``max_deliveries`` and publishes a result first;
- results to the topic named by the message's ``result_queue_name`` (topic id or full path) or
  ``backfill-results``; data = result JSON, attribute ``id``. Missing result topics are created.
- a request message's attributes are merged into its ``metadata`` (an attribute wins), as
  llm-d-async's Pub/Sub flow does, so e.g. its ``userid`` attribute names the tenant (the
  processor's ``tenant_attribute``).

Leases: after each pull the ack deadline of the pulled messages is set to the lease (seconds, rounded
up, 1–600); :meth:`PubSubBackend.extend` renews it; :meth:`~PubSubBackend.nack` sets it to the delay.
Delivery counts come from ``delivery_attempt`` (filled because of the dead-letter policy), else from an
in-process count per message id. Id claims (dedup on redelivery) are kept in-process
(:class:`~async_processor.backends.base.ClaimTable`). Across processors, one result per id rests on
the lease: a delivery whose lease went unrenewed (its processor stalled past it) may be another
subscriber's now, so :meth:`PubSubBackend.extend` reports it lost and the processor drops it
instead of running it or publishing its result; a stall that begins during the publish call itself
can still let a second result through, and result consumers key on ``id`` (the batch collector does).

``emulator_host`` (``host:port``, else ``PUBSUB_EMULATOR_HOST``) points the clients at Google's
emulator or at :mod:`async_processor.backends.pubsub_fake` with anonymous credentials.
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import time
from collections.abc import Sequence

import grpc
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import pubsub_v1
from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport

from async_processor.backends.base import Admission, ClaimTable, Delivery
from async_processor.errors import BackendError
from common.contracts.queue import (
    DEFAULT_POOL,
    DEFAULT_RESULT_TOPIC,
    REQUEST_TOPIC_PREFIX,
    RequestMessage,
    ResultMessage,
    decode_result,
    encode_request,
    encode_result,
    parse_result_address,
    pubsub_dead_letter_subscription,
    pubsub_dead_letter_topic,
    pubsub_request_topic,
    pubsub_subscription,
    with_attributes,
)

_API_ERRORS = (gexc.GoogleAPIError,)
LEASE_MARGIN = 0.05
"""A held message counts as lost when this fraction of its lease is left unrenewed (the ack
deadline runs from the modify call, a little before the processor notes it)."""


def make_clients(emulator_host: str = "") -> tuple[pubsub_v1.PublisherClient, pubsub_v1.SubscriberClient]:
    """A publisher and a subscriber client; with ``emulator_host`` (or ``PUBSUB_EMULATOR_HOST``)
    they talk plaintext gRPC to that address with anonymous credentials."""
    host = emulator_host or os.environ.get("PUBSUB_EMULATOR_HOST", "")
    if not host:
        return pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    creds = AnonymousCredentials()
    # Transport instances, not factories: with PUBSUB_EMULATOR_HOST set the client checks
    # ``issubclass`` on a callable transport and a ``functools.partial`` fails it.
    return (pubsub_v1.PublisherClient(transport=PublisherGrpcTransport(
                channel=grpc.insecure_channel(host), credentials=creds)),
            pubsub_v1.SubscriberClient(transport=SubscriberGrpcTransport(
                channel=grpc.insecure_channel(host), credentials=creds)))


def _seconds(value: float) -> int:
    return max(0, min(600, math.ceil(value)))


class PubSubBackend:
    """See the module docstring. Durations in seconds."""

    name = "pubsub"

    def __init__(self, project: str, *, pool: str = DEFAULT_POOL, lanes: Sequence[str] = (),
                 topic_prefix: str = REQUEST_TOPIC_PREFIX, result_topic: str = DEFAULT_RESULT_TOPIC,
                 max_deliveries: int = 5, done_ttl_s: float = 86400.0, emulator_host: str = ""):
        self.project = project
        self.pool = pool
        self.lanes = list(lanes)
        self.topic_prefix = topic_prefix
        self.result_topic = result_topic
        self.max_attempts = min(100, max(5, max_deliveries + 2))
        self.publisher, self.subscriber = make_clients(emulator_host)
        self.claims = ClaimTable(done_ttl_s)
        self._counts: dict[str, int] = {}
        self._topics: set[str] = set()
        self._ready: set[str] = set()

    @classmethod
    def from_settings(cls, settings) -> PubSubBackend:
        """From :class:`~async_processor.settings.ProcessorSettings`."""
        return cls(settings.pubsub_project, pool=settings.pool, lanes=settings.lanes,
                   topic_prefix=settings.pubsub_topic_prefix, result_topic=settings.result_topic,
                   max_deliveries=settings.max_deliveries, done_ttl_s=settings.dedup_ttl_s,
                   emulator_host=settings.pubsub_emulator_host)

    # names
    def topic_id(self, lane: str) -> str:
        """Topic id of ``lane``."""
        return pubsub_request_topic(lane, self.pool, self.topic_prefix)

    def topic_path(self, topic: str) -> str:
        """Full path of a topic id (a full path is returned as it is)."""
        return topic if topic.startswith("projects/") else f"projects/{self.project}/topics/{topic}"

    def subscription_path(self, name: str) -> str:
        """Full path of a subscription id."""
        return f"projects/{self.project}/subscriptions/{name}"

    def subscription(self, lane: str) -> str:
        """Full path of the processors' subscription of ``lane``."""
        return self.subscription_path(pubsub_subscription(self.topic_id(lane)))

    # set-up
    def _create_topic(self, path: str) -> None:
        if path in self._topics:
            return
        try:
            self.publisher.create_topic(request={"name": path})
        except gexc.AlreadyExists:
            pass
        self._topics.add(path)

    def _create_subscription(self, path: str, topic: str, ack_deadline_s: int = 10,
                             dead_topic: str | None = None) -> None:
        request = {"name": path, "topic": topic, "ack_deadline_seconds": ack_deadline_s}
        if dead_topic:
            request["dead_letter_policy"] = {"dead_letter_topic": dead_topic,
                                             "max_delivery_attempts": self.max_attempts}
        try:
            self.subscriber.create_subscription(request=request)
        except gexc.AlreadyExists:
            pass

    def _ensure_lane(self, lane: str) -> None:
        if lane in self._ready:
            return
        topic, dead = self.topic_path(self.topic_id(lane)), self.topic_path(pubsub_dead_letter_topic(self.topic_id(lane)))
        self._create_topic(topic)
        self._create_topic(dead)
        self._create_subscription(self.subscription_path(pubsub_dead_letter_subscription(self.topic_id(lane))), dead)
        self._create_subscription(self.subscription(lane), topic, dead_topic=dead)
        self._ready.add(lane)

    async def start(self) -> None:
        """Create every lane's topics and subscriptions and the default result topic."""
        def setup():
            for lane in self.lanes:
                self._ensure_lane(lane)
            self._create_topic(self.topic_path(self.result_topic))
        await self._call(setup)

    async def close(self) -> None:
        """Close both clients (held messages come back after their ack deadline)."""
        await asyncio.to_thread(self.publisher.stop)
        await asyncio.to_thread(self.subscriber.close)

    async def _call(self, fn, *args, **kwargs):
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except _API_ERRORS as exc:
            raise BackendError(f"pubsub: {exc}") from exc

    # leases
    async def receive(self, lane: str, max_messages: int, lease_s: float) -> list[Delivery]:
        """One pull (returns at once when empty), then the ack deadline set to the lease."""
        def pull():
            self._ensure_lane(lane)
            reply = self.subscriber.pull(request={"subscription": self.subscription(lane),
                                                  "max_messages": max_messages, "return_immediately": True},
                                         timeout=10)
            received = list(reply.received_messages)
            if received:
                self.subscriber.modify_ack_deadline(request={
                    "subscription": self.subscription(lane), "ack_ids": [m.ack_id for m in received],
                    "ack_deadline_seconds": max(1, _seconds(lease_s))})
            return received
        try:
            received = await self._call(pull)
        except BackendError as exc:
            if isinstance(exc.__cause__, gexc.DeadlineExceeded):
                return []
            raise
        out = []
        for m in received:
            count = m.delivery_attempt
            if not count:
                count = self._counts[m.message.message_id] = self._counts.get(m.message.message_id, 0) + 1
            body = with_attributes(bytes(m.message.data), dict(m.message.attributes))
            out.append(Delivery(lane, body, count, m.message.message_id, handle=m.ack_id))
        return out

    def _by_lane(self, deliveries: Sequence[Delivery]) -> dict[str, list[str]]:
        grouped: dict[str, list[str]] = {}
        for d in deliveries:
            grouped.setdefault(d.lane, []).append(d.handle)
        return grouped

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """``Acknowledge`` per lane."""
        if not deliveries:
            return
        def ack():
            for lane, ids in self._by_lane(deliveries).items():
                self.subscriber.acknowledge(request={"subscription": self.subscription(lane), "ack_ids": ids})
        await self._call(ack)
        for d in deliveries:
            self._counts.pop(d.transport_id, None)

    async def _modack(self, deliveries: Sequence[Delivery], seconds: int) -> None:
        if not deliveries:
            return
        def modack():
            for lane, ids in self._by_lane(deliveries).items():
                self.subscriber.modify_ack_deadline(request={"subscription": self.subscription(lane),
                                                             "ack_ids": ids, "ack_deadline_seconds": seconds})
        await self._call(modack)

    async def nack(self, deliveries: Sequence[Delivery], delay_s: float = 0.0) -> None:
        """Ack deadline set to ``delay_s`` (rounded up to whole seconds)."""
        await self._modack(deliveries, _seconds(delay_s))

    async def extend(self, deliveries: Sequence[Delivery], lease_s: float) -> list[Delivery]:
        """Ack deadline set to ``lease_s`` from now; claims follow. Lost: deliveries not renewed
        within their lease (``Delivery.extended_at`` older than ``lease_s``, less a margin): Pub/Sub
        may have delivered them to another subscriber since, so they are not renewed. Renewed ones
        get ``extended_at`` = the time of the call."""
        now = time.monotonic()
        lost = [d for d in deliveries if now - d.extended_at >= lease_s * (1 - LEASE_MARGIN)]
        kept = [d for d in deliveries if d not in lost]
        await self._modack(kept, max(1, _seconds(lease_s)))
        self.claims.extend([d.request_id for d in kept if d.request_id], lease_s)
        for d in kept:
            d.extended_at = now
        return lost

    async def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> None:
        """Publish to the lane's ``-dead`` topic (attributes ``reason``, ``source_id``, ``deliveries``),
        then ack."""
        if not deliveries:
            return
        futures = [self.publisher.publish(self.topic_path(pubsub_dead_letter_topic(self.topic_id(d.lane))), d.body,
                                          reason=reason[:1024], source_id=d.transport_id,
                                          deliveries=str(d.delivery_count)) for d in deliveries]
        await self._wait(futures)
        await self.ack(deliveries)

    async def _wait(self, futures) -> None:
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except _API_ERRORS as exc:
            raise BackendError(f"pubsub publish: {exc}") from exc

    async def publish_results(self, results: Sequence[tuple[ResultMessage, str]]) -> list[bool]:
        """Publish each result (attribute ``id``) whose id is not done in-process, wait until all are
        accepted; the ids are marked done first (and forgotten again if the publish fails)."""
        if not results:
            return []
        ids = [r.id for r, _ in results]
        published = self.claims.finish(ids)
        results = [pair for pair, ok in zip(results, published) if ok]
        try:
            await self._publish_results(results)
        except BaseException:
            self.claims.forget([r.id for r, _ in results if r.id])
            raise
        return published

    async def _publish_results(self, results: Sequence[tuple[ResultMessage, str]]) -> None:
        if not results:
            return
        topics = {self._result_topic(queue) for _, queue in results}

        def create_topics() -> None:
            for topic in topics:
                self._create_topic(topic)
        await self._call(create_topics)
        await self._wait([self.publisher.publish(self._result_topic(queue), encode_result(r),
                                                 id=r.id) for r, queue in results])

    async def publish_request(self, lane: str, message: RequestMessage | bytes) -> str:
        """Publish to the lane's topic; returns the Pub/Sub message id."""
        body = message if isinstance(message, bytes) else encode_request(message)
        await self._call(self._ensure_lane, lane)
        try:
            return await asyncio.wrap_future(self.publisher.publish(self.topic_path(self.topic_id(lane)), body))
        except _API_ERRORS as exc:
            raise BackendError(f"pubsub publish: {exc}") from exc

    async def admit(self, requests: Sequence[RequestMessage], lease_s: float) -> list[Admission]:
        """In-process claims (see module docstring)."""
        return self.claims.admit(requests, lease_s)

    async def cancelled_batches(self, batch_ids: Sequence[str]) -> set[str]:
        """See :meth:`QueueBackend.cancelled_batches` (in-process markers only: Pub/Sub has no shared marker store)."""
        return self.claims.cancelled_among(batch_ids)

    def _result_topic(self, queue: str) -> str:
        """The topic path of a result queue name ("" = ``result_topic``); a Redis list or channel
        address (an llm-d-async envelope sent over Pub/Sub) goes to ``result_topic``, as
        llm-d-async's Pub/Sub flow publishes every result on its result topic."""
        address = parse_result_address(queue)
        return self.topic_path((address.name if address.kind == "stream" else "") or self.result_topic)

    async def cancelled_requests(self, requests: Sequence[RequestMessage]) -> set[str]:
        """None: llm-d-async's cancel keys live in Redis only."""
        return set()

    async def release(self, ids: Sequence[str]) -> None:
        """Drop in-process running claims."""
        self.claims.release(ids)

    def result_reader(self, queue_name: str = "") -> PubSubResultReader:
        """Creates (blocking) a fresh subscription on the result topic; it sees results published
        from now on and is deleted by ``close()``."""
        topic = self.topic_path(queue_name or self.result_topic)
        self._create_topic(topic)
        name = self.subscription_path(topic.rsplit("/", 1)[-1] + "-reader-" + secrets.token_hex(4))
        self._create_subscription(name, topic, ack_deadline_s=60)
        return PubSubResultReader(self.subscriber, name)


class PubSubResultReader:
    """Pulls and acks results from its own subscription."""

    def __init__(self, subscriber: pubsub_v1.SubscriberClient, subscription: str):
        self.subscriber, self.subscription = subscriber, subscription

    async def read(self, timeout_s: float) -> list[ResultMessage]:
        """Results available now, or the first batch within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while True:
            reply = await asyncio.to_thread(self.subscriber.pull, request={
                "subscription": self.subscription, "max_messages": 1000, "return_immediately": True}, timeout=10)
            received = list(reply.received_messages)
            if received:
                await asyncio.to_thread(self.subscriber.acknowledge, request={
                    "subscription": self.subscription, "ack_ids": [m.ack_id for m in received]})
                return [decode_result(bytes(m.message.data)) for m in received]
            if loop.time() >= until:
                return []
            await asyncio.sleep(min(0.05, max(0.0, until - loop.time())))

    async def close(self) -> None:
        """Delete the subscription."""
        try:
            await asyncio.to_thread(self.subscriber.delete_subscription, request={"subscription": self.subscription})
        except _API_ERRORS:
            pass

"""An in-process fake of the Google Pub/Sub gRPC API, for machines without Google's emulator.

The real ``google-cloud-pubsub`` client talks to it unchanged (``PUBSUB_EMULATOR_HOST`` or the
``emulator_host`` of :class:`~async_processor.backends.pubsub.PubSubBackend`). It is a
``grpc.server`` with generic handlers for ``google.pubsub.v1.Publisher`` and
``google.pubsub.v1.Subscriber`` whose messages are (de)serialised with the proto-plus types of
``google.pubsub_v1.types``.

Served: ``CreateTopic``, ``GetTopic``, ``DeleteTopic``, ``Publish``; ``CreateSubscription``,
``GetSubscription``, ``DeleteSubscription``, ``Pull`` (``return_immediately`` or a wait of up to
``max_pull_wait_s``), ``Acknowledge``, ``ModifyAckDeadline`` (0 = nack) and ``StreamingPull`` (what
``SubscriberClient.subscribe()`` uses). Kept: ack deadlines (redelivery after a lapse, with a new ack
id; acks of stale ack ids are ignored), dead-letter policies (``delivery_attempt`` counted, message
forwarded to the dead-letter topic after ``max_delivery_attempts``). Not kept: ordering keys,
filters, exactly-once delivery, retention, seek, snapshots, schemas. Everything lives in memory.

    with PubSubFake() as fake:          # 127.0.0.1, a free port
        os.environ["PUBSUB_EMULATOR_HOST"] = fake.host
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
from google.protobuf import empty_pb2, timestamp_pb2
from google.pubsub_v1 import types


@dataclass
class _Pending:
    message: types.PubsubMessage
    attempts: int = 0
    visible_at: float = 0.0
    ack_id: str = ""


@dataclass
class _Subscription:
    proto: types.Subscription
    messages: dict[str, _Pending] = field(default_factory=dict)  # message id -> state, publish order


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, text: str) -> NoReturn:
    context.abort(code, text)
    raise AssertionError("grpc's abort raises")


class PubSubFake:
    """The fake server. ``port`` 0 picks a free one; :attr:`host` is ``127.0.0.1:PORT`` once
    started. ``max_pull_wait_s``: how long a non-immediate ``Pull`` waits for messages."""

    def __init__(self, port: int = 0, *, max_pull_wait_s: float = 1.0, workers: int = 16):
        self.max_pull_wait_s = max_pull_wait_s
        self._lock = threading.Condition()
        self._topics: dict[str, types.Topic] = {}
        self._subs: dict[str, _Subscription] = {}
        self._ids = itertools.count(1)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        self._server.add_generic_rpc_handlers([self._publisher_handler(), self._subscriber_handler()])
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.host = f"127.0.0.1:{self.port}"

    def start(self) -> PubSubFake:
        """Start serving; returns self."""
        self._server.start()
        return self

    def stop(self, grace_s: float = 0.5) -> None:
        """Stop serving (open streams are cancelled after ``grace_s`` seconds)."""
        self._server.stop(grace_s).wait()

    def __enter__(self) -> PubSubFake:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ handlers

    def _publisher_handler(self):
        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.deserialize,
                                                       response_serializer=resp.serialize)
        return grpc.method_handlers_generic_handler("google.pubsub.v1.Publisher", {
            "CreateTopic": unary(self.create_topic, types.Topic, types.Topic),
            "GetTopic": unary(self.get_topic, types.GetTopicRequest, types.Topic),
            "DeleteTopic": grpc.unary_unary_rpc_method_handler(
                self.delete_topic, request_deserializer=types.DeleteTopicRequest.deserialize,
                response_serializer=empty_pb2.Empty.SerializeToString),
            "Publish": unary(self.publish, types.PublishRequest, types.PublishResponse),
        })

    def _subscriber_handler(self):
        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.deserialize,
                                                       response_serializer=resp.serialize)

        def empty(fn, req):
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.deserialize,
                                                       response_serializer=empty_pb2.Empty.SerializeToString)
        return grpc.method_handlers_generic_handler("google.pubsub.v1.Subscriber", {
            "CreateSubscription": unary(self.create_subscription, types.Subscription, types.Subscription),
            "GetSubscription": unary(self.get_subscription, types.GetSubscriptionRequest, types.Subscription),
            "DeleteSubscription": empty(self.delete_subscription, types.DeleteSubscriptionRequest),
            "Pull": unary(self.pull, types.PullRequest, types.PullResponse),
            "Acknowledge": empty(self.acknowledge, types.AcknowledgeRequest),
            "ModifyAckDeadline": empty(self.modify_ack_deadline, types.ModifyAckDeadlineRequest),
            "StreamingPull": grpc.stream_stream_rpc_method_handler(
                self.streaming_pull, request_deserializer=types.StreamingPullRequest.deserialize,
                response_serializer=types.StreamingPullResponse.serialize),
        })

    # ------------------------------------------------------------ publisher

    def create_topic(self, request: types.Topic, context) -> types.Topic:
        with self._lock:
            if request.name in self._topics:
                _abort(context, grpc.StatusCode.ALREADY_EXISTS, f"Topic already exists: {request.name}")
            self._topics[request.name] = types.Topic(name=request.name)
            return self._topics[request.name]

    def get_topic(self, request: types.GetTopicRequest, context) -> types.Topic:
        with self._lock:
            if request.topic not in self._topics:
                _abort(context, grpc.StatusCode.NOT_FOUND, f"Topic not found: {request.topic}")
            return self._topics[request.topic]

    def delete_topic(self, request: types.DeleteTopicRequest, context):
        with self._lock:
            if self._topics.pop(request.topic, None) is None:
                _abort(context, grpc.StatusCode.NOT_FOUND, f"Topic not found: {request.topic}")
            return empty_pb2.Empty()

    def publish(self, request: types.PublishRequest, context) -> types.PublishResponse:
        with self._lock:
            if request.topic not in self._topics:
                _abort(context, grpc.StatusCode.NOT_FOUND, f"Topic not found: {request.topic}")
            ids = [self._deliver_to_topic(request.topic, m) for m in request.messages]
            self._lock.notify_all()
            return types.PublishResponse(message_ids=ids)

    def _deliver_to_topic(self, topic: str, message: types.PubsubMessage) -> str:
        message_id = str(next(self._ids))
        stamp = timestamp_pb2.Timestamp()
        stamp.GetCurrentTime()
        stored = types.PubsubMessage(data=message.data, attributes=dict(message.attributes),
                                     ordering_key=message.ordering_key, message_id=message_id,
                                     publish_time=stamp)
        for sub in self._subs.values():
            if sub.proto.topic == topic:
                sub.messages[message_id] = _Pending(stored)
        return message_id

    # ------------------------------------------------------------ subscriber

    def create_subscription(self, request: types.Subscription, context) -> types.Subscription:
        with self._lock:
            if request.name in self._subs:
                _abort(context, grpc.StatusCode.ALREADY_EXISTS, f"Subscription already exists: {request.name}")
            if request.topic not in self._topics:
                _abort(context, grpc.StatusCode.NOT_FOUND, f"Topic not found: {request.topic}")
            proto = types.Subscription(request)
            if not proto.ack_deadline_seconds:
                proto.ack_deadline_seconds = 10
            self._subs[request.name] = _Subscription(proto)
            return proto

    def get_subscription(self, request: types.GetSubscriptionRequest, context) -> types.Subscription:
        with self._lock:
            return self._sub(request.subscription, context).proto

    def delete_subscription(self, request: types.DeleteSubscriptionRequest, context):
        with self._lock:
            if self._subs.pop(request.subscription, None) is None:
                _abort(context, grpc.StatusCode.NOT_FOUND, f"Subscription not found: {request.subscription}")
            return empty_pb2.Empty()

    def _sub(self, name: str, context) -> _Subscription:
        sub = self._subs.get(name)
        if sub is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"Subscription not found: {name}")
        return sub

    def _take(self, sub: _Subscription, max_messages: int, deadline_s: float) -> list[types.ReceivedMessage]:
        """Lease up to ``max_messages`` visible messages (caller holds the lock)."""
        now = time.monotonic()
        policy = sub.proto.dead_letter_policy if "dead_letter_policy" in sub.proto else None
        out: list[types.ReceivedMessage] = []
        for message_id, pending in list(sub.messages.items()):
            if len(out) >= max_messages:
                break
            if pending.visible_at > now:
                continue
            if policy and policy.dead_letter_topic and pending.attempts >= (policy.max_delivery_attempts or 5):
                del sub.messages[message_id]
                if policy.dead_letter_topic in self._topics:
                    self._deliver_to_topic(policy.dead_letter_topic, pending.message)
                continue
            pending.attempts += 1
            pending.visible_at = now + deadline_s
            pending.ack_id = f"{sub.proto.name}:{message_id}:{pending.attempts}"
            out.append(types.ReceivedMessage(ack_id=pending.ack_id, message=pending.message,
                                             delivery_attempt=pending.attempts if policy else 0))
        return out

    def _find(self, sub: _Subscription, ack_id: str) -> _Pending | None:
        message_id = ack_id.rsplit(":", 2)[-2] if ack_id.count(":") >= 2 else ""
        pending = sub.messages.get(message_id)
        return pending if pending is not None and pending.ack_id == ack_id else None

    def pull(self, request: types.PullRequest, context) -> types.PullResponse:
        until = time.monotonic() + (0 if request.return_immediately else self.max_pull_wait_s)
        with self._lock:
            while True:
                sub = self._sub(request.subscription, context)
                got = self._take(sub, request.max_messages or 1000, sub.proto.ack_deadline_seconds)
                left = until - time.monotonic()
                if got or left <= 0:
                    return types.PullResponse(received_messages=got)
                self._lock.wait(min(left, 0.05))

    def acknowledge(self, request: types.AcknowledgeRequest, context):
        with self._lock:
            sub = self._sub(request.subscription, context)
            for ack_id in request.ack_ids:
                pending = self._find(sub, ack_id)
                if pending is not None:
                    del sub.messages[pending.message.message_id]
            return empty_pb2.Empty()

    def _modify(self, sub: _Subscription, ack_ids, seconds: int) -> None:
        now = time.monotonic()
        for ack_id in ack_ids:
            pending = self._find(sub, ack_id)
            if pending is not None:
                pending.visible_at = now + seconds
        self._lock.notify_all()

    def modify_ack_deadline(self, request: types.ModifyAckDeadlineRequest, context):
        if not 0 <= request.ack_deadline_seconds <= 600:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "ack_deadline_seconds must be in [0, 600]")
        with self._lock:
            self._modify(self._sub(request.subscription, context), request.ack_ids, request.ack_deadline_seconds)
            return empty_pb2.Empty()

    def streaming_pull(self, requests: Iterator[types.StreamingPullRequest], context
                       ) -> Iterator[types.StreamingPullResponse]:
        first = next(requests)
        with self._lock:
            sub = self._sub(first.subscription, context)
        deadline_s = first.stream_ack_deadline_seconds or sub.proto.ack_deadline_seconds
        max_outstanding = first.max_outstanding_messages or 1000
        done = threading.Event()

        def apply(request: types.StreamingPullRequest) -> None:
            with self._lock:
                for ack_id in request.ack_ids:
                    pending = self._find(sub, ack_id)
                    if pending is not None:
                        del sub.messages[pending.message.message_id]
                by_seconds: dict[int, list[str]] = {}
                for ack_id, seconds in zip(request.modify_deadline_ack_ids, request.modify_deadline_seconds):
                    by_seconds.setdefault(seconds, []).append(ack_id)
                for seconds, ack_ids in by_seconds.items():
                    self._modify(sub, ack_ids, seconds)

        def consume() -> None:
            try:
                apply(first)
                for request in requests:
                    apply(request)
            except Exception:  # the client closed the stream
                pass
            finally:
                done.set()
                with self._lock:
                    self._lock.notify_all()

        threading.Thread(target=consume, daemon=True, name="fake-streaming-pull").start()
        while not done.is_set() and context.is_active():
            with self._lock:
                if first.subscription not in self._subs:
                    return
                got = self._take(sub, max_outstanding, deadline_s)
                if not got:
                    self._lock.wait(0.05)
                    continue
            yield types.StreamingPullResponse(received_messages=got)

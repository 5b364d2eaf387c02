"""The queue contract: request and result messages, error codes, and every stream, topic, consumer
group and marker name. The processor, the workers, the dashboard and queue producers import these
names from here and nowhere else.

Formats follow llm-d-async (``llm-d/llm-d-async`` ``api/api.go``) so its producers work unchanged;
backfill's additions live only in ``metadata``. See ``shared/contracts/queue-and-headers.md``.

Request message (JSON object)::

    {"id": "req-1", "created": 1735689600, "deadline": 1735693200,
     "payload": {"model": "m", "messages": [...]},          # the OpenAI request body
     "endpoint": "/v1/chat/completions",                     # default when absent
     "headers": {"x-custom": "v"},                            # forwarded to the router
     "metadata": {"tenant": "acme", "objective": "batch", "batch_id": "batch_1",
                  "custom_id": "line-7", "session_id": "", "traceparent": ""},
     "result_queue_name": "backfill:results"}                 # optional; default result queue else

Result message (JSON object, every field always present)::

    {"id": "req-1", "status_code": 200, "payload": "<upstream body as a string>",
     "error_code": "", "error_message": "", "metadata": {...request metadata...}}

``status_code`` is the router's HTTP status, 0 when there was no HTTP response; ``error_code`` is
``""`` on any HTTP answer and one of :class:`ErrorCode` otherwise. Exactly one terminal result is
published per request ``id`` by a healthy fleet; consumers still dedup by ``id`` (at-least-once).

Where messages live (``pool`` defaults to ``"default"``, lanes are ``interactive``/``async``/``batch``):

- Redis Streams: requests are ``XADD``-ed to :func:`request_stream` with one field
  :data:`REQUEST_FIELD` holding the JSON; results are ``XADD``-ed to the message's
  ``result_queue_name`` (a stream) or :data:`DEFAULT_RESULT_STREAM`, field :data:`RESULT_FIELD`.
- Google Pub/Sub: requests are published to :func:`pubsub_request_topic` (data = the JSON);
  results to the topic named by ``result_queue_name`` or :data:`DEFAULT_RESULT_TOPIC`, data = the
  result JSON, attribute ``id``.
- The batch lifecycle publishes to the ``batch`` lane (:data:`BATCH_LANE`) with
  ``result_queue_name`` :data:`BATCH_RESULT_STREAM`, read by the consumer group
  :data:`COLLECTOR_GROUP`; processors share the group :data:`PROCESSOR_GROUP` (Redis) or the
  subscription :func:`pubsub_subscription` (Pub/Sub).
- Cancellation: a batch is cancelled for the processor while the Redis key
  :func:`cancel_marker_key` exists; its queued messages then get a ``CANCELLED`` result.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
import orjson

DEFAULT_ENDPOINT = "/v1/chat/completions"
DEFAULT_POOL = "default"

#: Objective (lane) name -> priority band; higher runs first, negative is sheddable (DESIGN.md).
LANE_PRIORITIES: dict[str, int] = {"interactive": 100, "async": 10, "batch": -10}

REQUEST_FIELD = "message"
RESULT_FIELD = "result"
DEFAULT_RESULT_STREAM = "backfill:results"
DEFAULT_RESULT_TOPIC = "backfill-results"
REQUEST_STREAM_PREFIX = "backfill:requests"
REQUEST_TOPIC_PREFIX = "backfill-requests"
PROCESSOR_GROUP = "backfill-processors"
"""Redis consumer group every processor shares on the request streams."""

BATCH_LANE = "batch"
BATCH_RESULT_STREAM = "backfill:results:batch"
"""Result stream of batch requests (their ``result_queue_name``)."""
COLLECTOR_GROUP = "collectors"
"""Consumer group of the batch collectors on :data:`BATCH_RESULT_STREAM`."""


class InvalidMessage(ValueError):
    """A message that cannot be decoded or lacks a required field.

    ``reason``: human-readable cause. ``id``, ``metadata`` and ``result_queue_name`` are whatever
    could be salvaged from the raw bytes (empty when nothing could), so an ``INVALID_REQUEST``
    result can still be addressed to the producer.
    """

    def __init__(self, reason: str, *, id: str = "", metadata: dict[str, str] | None = None,
                 result_queue_name: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.id = id
        self.metadata = metadata or {}
        self.result_queue_name = result_queue_name


class ErrorCode(enum.StrEnum):
    """``error_code`` of a result that carries no HTTP answer (llm-d-async's ``ErrCode*``)."""

    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    GATE_DROPPED = "GATE_DROPPED"
    GATE_ERROR = "GATE_ERROR"
    INFERENCE_ERROR = "INFERENCE_ERROR"
    INFERENCE_TIMEOUT = "INFERENCE_TIMEOUT"
    """The router had the request for the whole attempt timeout without answering; not retried."""
    INVALID_REQUEST = "INVALID_REQUEST"


class RequestMessage(msgspec.Struct, kw_only=True, frozen=True):
    """One queued request. ``created`` and ``deadline`` are Unix seconds; ``deadline`` must be > 0.

    Unknown fields (e.g. llm-d's ``request_queue_name``, ``pubsub_id``) are accepted and ignored.
    """

    id: Annotated[str, msgspec.Meta(min_length=1)]
    deadline: Annotated[int, msgspec.Meta(gt=0)]
    payload: dict[str, Any]
    created: int = 0
    endpoint: str = DEFAULT_ENDPOINT
    headers: dict[str, str] = {}
    metadata: dict[str, str] = {}
    result_queue_name: str = ""

    @property
    def tenant(self) -> str:
        """``metadata["tenant"]`` or ``""``."""
        return self.metadata.get("tenant", "")

    @property
    def objective(self) -> str:
        """``metadata["objective"]`` or ``""`` (the lane the producer meant)."""
        return self.metadata.get("objective", "")


class ResultMessage(msgspec.Struct, kw_only=True, frozen=True):
    """The terminal outcome of one request (see the module docstring for field meanings)."""

    id: str
    status_code: int = 0
    payload: str = ""
    error_code: str = ""
    error_message: str = ""
    metadata: dict[str, str] = {}

    @property
    def ok(self) -> bool:
        """True for a 2xx HTTP answer."""
        return 200 <= self.status_code < 300 and not self.error_code


_request_decoder = msgspec.json.Decoder(RequestMessage)
_result_decoder = msgspec.json.Decoder(ResultMessage)
_encoder = msgspec.json.Encoder()


def encode_request(message: RequestMessage) -> bytes:
    """The JSON bytes of ``message`` (UTF-8)."""
    return _encoder.encode(message)


def encode_result(result: ResultMessage) -> bytes:
    """The JSON bytes of ``result`` (UTF-8), every field present."""
    return _encoder.encode(result)


def decode_result(data: bytes | str) -> ResultMessage:
    """Parse a result message. Raises :class:`InvalidMessage` when it is not one."""
    try:
        return _result_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise InvalidMessage(f"not a result message: {exc}") from None


def _salvage(data: bytes | str) -> dict[str, Any]:
    """Best-effort ``id``/``metadata``/``result_queue_name`` from a message that failed to decode."""
    try:
        raw = orjson.loads(data)
    except Exception:
        return {}
    if not isinstance(raw, dict):
        return {}
    found: dict[str, Any] = {}
    if isinstance(raw.get("id"), str):
        found["id"] = raw["id"]
    meta = raw.get("metadata")
    if isinstance(meta, dict):
        found["metadata"] = {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, str)}
    if isinstance(raw.get("result_queue_name"), str):
        found["result_queue_name"] = raw["result_queue_name"]
    return found


def decode_request(data: bytes | str) -> RequestMessage:
    """Parse and validate a request message.

    Raises :class:`InvalidMessage` (with whatever ``id``, ``metadata`` and ``result_queue_name``
    could be salvaged) when ``data`` is not JSON, not an object, lacks ``id``/``deadline``/``payload``,
    has a non-positive deadline or mistyped fields. A past deadline is *not* invalid: the processor
    answers it with ``DEADLINE_EXCEEDED``.
    """
    try:
        return _request_decoder.decode(data)
    except Exception as exc:  # msgspec errors, bad UTF-8, recursion limits: all mean "not a request"
        raise InvalidMessage(f"invalid request message: {exc}", **_salvage(data)) from None


def http_result(request: RequestMessage, status_code: int, body: bytes | str) -> ResultMessage:
    """A result carrying the router's HTTP answer (any status); ``error_code`` stays empty."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return ResultMessage(id=request.id, status_code=status_code, payload=text, metadata=dict(request.metadata))


def error_result(id: str, code: ErrorCode, message: str, metadata: dict[str, str] | None = None,
                 status_code: int = 0) -> ResultMessage:
    """A result without an HTTP answer. ``payload`` is ``{"error": message}`` as JSON, as llm-d-async
    writes it for consumers that only read ``payload``."""
    return ResultMessage(id=id, status_code=status_code, payload=orjson.dumps({"error": message}).decode(),
                         error_code=str(code), error_message=message, metadata=dict(metadata or {}))


def invalid_request_result(error: InvalidMessage) -> ResultMessage:
    """The ``INVALID_REQUEST`` result for a message that failed :func:`decode_request`."""
    return error_result(error.id, ErrorCode.INVALID_REQUEST, error.reason, error.metadata)


def request_stream(lane: str, pool: str = DEFAULT_POOL, prefix: str = REQUEST_STREAM_PREFIX) -> str:
    """Redis stream of one (pool, lane): ``backfill:requests:{pool}:{lane}``."""
    return f"{prefix}:{pool}:{lane}"


def dead_letter_stream(stream: str) -> str:
    """Redis stream receiving entries of ``stream`` after too many deliveries: ``{stream}:dead``."""
    return f"{stream}:dead"


def pubsub_request_topic(lane: str, pool: str = DEFAULT_POOL, prefix: str = REQUEST_TOPIC_PREFIX) -> str:
    """Pub/Sub topic id of one (pool, lane): ``backfill-requests-{pool}-{lane}``."""
    return f"{prefix}-{pool}-{lane}"


def pubsub_subscription(topic_id: str) -> str:
    """Subscription id every processor shares on a request topic: ``{topic_id}-processor``."""
    return f"{topic_id}-processor"


def pubsub_dead_letter_topic(topic_id: str) -> str:
    """Dead-letter topic id of a request topic: ``{topic_id}-dead``."""
    return f"{topic_id}-dead"


def pubsub_dead_letter_subscription(topic_id: str) -> str:
    """Subscription id on the dead-letter topic (so dead letters are kept): ``{topic_id}-dead-reader``."""
    return f"{topic_id}-dead-reader"


def cancel_marker_key(batch_id: str) -> str:
    """Redis key whose existence cancels every queued message with ``metadata.batch_id``."""
    return f"backfill:cancel:batch:{batch_id}"

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

llm-d-async's own wire format (``api/internal_api.go`` ``internalRequestWire``) is accepted too: the
envelope ``{"internal": {"request_token", "request_queue_name", "result_queue_name", ...},
"request_kind": "plain" | "redis" | "pubsub", "data": {<request message>}}``. Its result goes where
llm-d-async's consumers read it: ``LPUSH`` to the Redis list ``internal.result_queue_name`` (else
``data.result_queue_name``, else :data:`LLMD_RESULT_LIST`), read with ``BRPOP``; a message that
came through the redis-pubsub transport is answered with ``PUBLISH`` on the result channel. The
processor carries that destination as a *result address* (:func:`result_list_address`,
:func:`result_channel_address`, :func:`parse_result_address`) in ``result_queue_name``; a plain
name stays a Redis stream (or Pub/Sub topic). ``internal.request_token`` is the request generation
of llm-d-async's cancel keys: the request is cancelled while ``GET`` :func:`request_cancel_key`
equals it; :func:`request_active_key` holds it while the request is live.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Annotated, Any, NamedTuple

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

LLMD_REQUEST_SORTED_SET = "request-sortedset"
"""llm-d-async's default request sorted set (``producer/redis_sortedset_producer.go``), scored by deadline."""
LLMD_RETRY_SORTED_SET = "retry-sortedset"
"""llm-d-async's default retry sorted set (``pkg/redis/options.go`` ``retry_queue_name``): its own
consumer parks a retryable failure there, scored by the Unix second it is due, the member its
envelope (``pkg/redis/sortedset_impl.go`` ``flushRetryBatch``); producers never write it."""
LLMD_REQUEST_CHANNEL = "request-queue"
"""llm-d-async's default redis-pubsub request channel (``PUBLISH request-queue <envelope>``)."""
LLMD_RESULT_LIST = "result-list"
"""llm-d-async's default sorted-set result list (``pkg/redis/options.go``), read with ``BRPOP``."""
LLMD_RESULT_CHANNEL = "result-queue"
"""llm-d-async's default redis-pubsub result channel (``pkg/redis/options.go``)."""
LLMD_TENANT_ATTRIBUTE = "userid"
"""llm-d-async's default tenant attribute (its quota gate and fairness stamping, ``fairness.go``)."""
LLMD_REQUEST_KINDS = ("plain", "redis", "pubsub")
RESULT_LIST_SCHEME = "redis-list"
RESULT_CHANNEL_SCHEME = "redis-channel"

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
    request_token: str = ""
    """llm-d-async's request generation (``internal.request_token``); "" for backfill's messages."""

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


class _Routing(msgspec.Struct, kw_only=True):
    """``internal`` of llm-d-async's envelope (``InternalRouting``); other fields ignored."""

    request_token: str = ""
    request_queue_name: str = ""
    result_queue_name: str = ""


class _Envelope(msgspec.Struct, kw_only=True):
    """llm-d-async's ``internalRequestWire``."""

    internal: _Routing = msgspec.field(default_factory=_Routing)
    request_kind: str
    data: RequestMessage


_request_decoder = msgspec.json.Decoder(RequestMessage)
_envelope_decoder = msgspec.json.Decoder(_Envelope)
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
    body = raw.get("data")
    inner: dict[str, Any] = body if isinstance(body, dict) else {}
    found: dict[str, Any] = {}
    for source in (raw, inner):  # a flat message, else the envelope's data
        if isinstance(source.get("id"), str) and source["id"] and "id" not in found:
            found["id"] = source["id"]
        meta = source.get("metadata")
        if isinstance(meta, dict) and "metadata" not in found:
            found["metadata"] = {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, str)}
    if _is_envelope(raw):
        internal = raw.get("internal")
        routing = internal if isinstance(internal, dict) else {}
        name = routing.get("result_queue_name") or inner.get("result_queue_name")
        token = routing.get("request_token")
        found["result_queue_name"] = result_list_address(name if isinstance(name, str) else "",
                                                         token if isinstance(token, str) else "")
    elif isinstance(raw.get("result_queue_name"), str):
        found["result_queue_name"] = raw["result_queue_name"]
    return found


def _is_envelope(raw: dict[str, Any]) -> bool:
    """llm-d-async's envelope: ``request_kind`` or ``internal`` beside ``data``."""
    return "request_kind" in raw or ("internal" in raw and "data" in raw)


def decode_request(data: bytes | str) -> RequestMessage:
    """Parse and validate a request message.

    Accepts backfill's flat message and llm-d-async's envelope (see the module docstring; its
    ``data`` is the request, answered on its result list). Raises :class:`InvalidMessage` (with
    whatever ``id``, ``metadata`` and ``result_queue_name`` could be salvaged, from ``data`` too) when ``data`` is not JSON, not an object, lacks ``id``/``deadline``/``payload``,
    has a non-positive deadline or mistyped fields. A past deadline is *not* invalid: the processor
    answers it with ``DEADLINE_EXCEEDED``.
    """
    try:
        try:
            return _request_decoder.decode(data)
        except msgspec.ValidationError:
            raw = orjson.loads(data)
            if not (isinstance(raw, dict) and _is_envelope(raw)):
                raise
        return _from_envelope(_envelope_decoder.decode(data))
    except Exception as exc:  # msgspec errors, bad UTF-8, recursion limits: all mean "not a request"
        raise InvalidMessage(f"invalid request message: {exc}", **_salvage(data)) from None


def _from_envelope(envelope: _Envelope) -> RequestMessage:
    """The request of an llm-d-async envelope, answered on its result list (see the module docstring).
    Raises ``ValueError`` for a ``request_kind`` llm-d-async does not define."""
    if envelope.request_kind not in LLMD_REQUEST_KINDS:
        raise ValueError(f"unknown request_kind {envelope.request_kind!r}")
    routing, data = envelope.internal, envelope.data
    token = routing.request_token
    address = result_list_address(routing.result_queue_name or data.result_queue_name, token)
    return msgspec.structs.replace(data, result_queue_name=address, request_token=token)


class ResultAddress(NamedTuple):
    """Where a result goes: ``kind`` ``"stream"`` (a Redis stream or Pub/Sub topic, backfill's
    default), ``"list"`` (``LPUSH``, llm-d-async's sorted-set transport) or ``"channel"``
    (``PUBLISH``, its redis-pubsub transport); ``name`` the key, topic or channel ("" = the
    default); ``token`` the request generation whose cancel/active keys are cleared with it."""

    kind: str
    name: str
    token: str = ""


def result_list_address(name: str = "", token: str = "") -> str:
    """``redis-list:{token}:{name}`` (name "" = :data:`LLMD_RESULT_LIST`)."""
    return f"{RESULT_LIST_SCHEME}:{token}:{name or LLMD_RESULT_LIST}"


def result_channel_address(name: str = "") -> str:
    """``redis-channel::{name}`` (name "" = :data:`LLMD_RESULT_CHANNEL`)."""
    return f"{RESULT_CHANNEL_SCHEME}::{name or LLMD_RESULT_CHANNEL}"


def parse_result_address(text: str) -> ResultAddress:
    """The :class:`ResultAddress` of a message's ``result_queue_name``: the two schemes above, any
    other text a stream (or topic) of that name. Tokens are hex, so the first ``:`` after the
    token ends it."""
    for scheme, kind in ((RESULT_LIST_SCHEME, "list"), (RESULT_CHANNEL_SCHEME, "channel")):
        if text.startswith(scheme + ":"):
            token, _, name = text[len(scheme) + 1:].partition(":")
            return ResultAddress(kind, name, token)
    return ResultAddress("stream", text)


def with_attributes(body: bytes, attributes: Mapping[str, str]) -> bytes:
    """``body`` with Pub/Sub message ``attributes`` merged into its ``metadata`` (an attribute wins
    over a metadata key of the same name), as llm-d-async's Pub/Sub flow does
    (``pkg/pubsub/pubsubimpl.go``). A body that is not a JSON object is returned unchanged (it is
    answered ``INVALID_REQUEST`` when decoded)."""
    if not attributes:
        return body
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(raw, dict):
        return body
    target = raw["data"] if _is_envelope(raw) and isinstance(raw.get("data"), dict) else raw
    meta = target.get("metadata")
    target["metadata"] = {**(meta if isinstance(meta, dict) else {}), **attributes}
    return orjson.dumps(raw)


def with_tenant(request: RequestMessage, attribute: str = LLMD_TENANT_ATTRIBUTE) -> RequestMessage:
    """``request`` with ``metadata.tenant`` set from ``metadata[attribute]`` when it has no tenant of
    its own (``metadata.tenant`` wins); unchanged otherwise or when ``attribute`` is ""."""
    if not attribute or request.metadata.get("tenant") or not request.metadata.get(attribute):
        return request
    return msgspec.structs.replace(request, metadata={**request.metadata, "tenant": request.metadata[attribute]})


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


def request_cancel_key(request_id: str) -> str:
    """llm-d-async's cancel marker of one request: ``request-cancel:{id}`` holding the cancelled
    ``request_token`` (``api.RequestCancellationKey``)."""
    return f"request-cancel:{request_id}"


def request_active_key(request_id: str) -> str:
    """llm-d-async's live generation of one request: ``request-active:{id}`` holding its
    ``request_token`` until the deadline (``api.RequestActiveTokenKey``)."""
    return f"request-active:{request_id}"


def cancel_marker_key(batch_id: str) -> str:
    """Redis key whose existence cancels every queued message with ``metadata.batch_id``."""
    return f"backfill:cancel:batch:{batch_id}"


RUNNING_REPORT_MAX_AGE_S = 10.0
"""A processor's report in :func:`running_key` older than this (s) is ignored: the processor
stopped or froze (it rewrites its report every ``running_report_s``, 1 s by default, while it has
batch requests in flight)."""


def running_key(pool: str = DEFAULT_POOL) -> str:
    """Redis hash of the batch requests each processor of ``pool`` has in flight at the router:
    field = the processor's name, value = JSON ``{"at": Unix s, "batches": {batch_id: n}}``
    (:func:`running_report`); read by :func:`running_counts`."""
    return f"backfill:running:{pool}"


def running_report(at: float, batches: Mapping[str, int]) -> bytes:
    """One processor's field of :func:`running_key`: ``{"at": at, "batches": {batch_id: n}}``."""
    return orjson.dumps({"at": at, "batches": dict(batches)})


def running_counts(fields: Mapping[bytes | str, bytes | str], now: float,
                   max_age_s: float = RUNNING_REPORT_MAX_AGE_S) -> dict[str, int]:
    """``{batch_id: requests in flight}`` summed over the processors' reports of :func:`running_key`
    (an ``HGETALL``) written within ``max_age_s`` of ``now``; unreadable fields are skipped."""
    total: dict[str, int] = {}
    for value in fields.values():
        try:
            report = orjson.loads(value)
            if now - float(report["at"]) > max_age_s:
                continue
            for batch_id, n in report["batches"].items():
                total[str(batch_id)] = total.get(str(batch_id), 0) + max(0, int(n))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            continue
    return total

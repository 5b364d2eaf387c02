"""Decoding vLLM KV-event messages: both event layouts, bytes and int hashes, tolerant of missing and
extra trailing fields, and a clear error for anything that is not an event batch."""

from __future__ import annotations

import msgpack
import pytest

from engine_twin import kv_events as sim_events
from router.kv_index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventDecodeError,
    block_hash_to_int,
    decode_message,
    decode_payload,
)


def frames(payload: bytes, topic: bytes = b"kv@127.0.0.1:8000@m", seq: int = 7) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


def packed(batch) -> bytes:
    return msgpack.packb(batch, use_bin_type=True)


@pytest.mark.parametrize("layout", ["map", "array"])
def test_the_simulators_batches_decode_in_both_layouts(layout):
    events = [
        sim_events.BlockStored([11, 12], None, list(range(32)), 16, medium="GPU", lora_id=3, lora_name="ad"),
        sim_events.BlockStored([12], None, [], 16, medium="CPU"),
        sim_events.BlockRemoved([11], "GPU"),
        sim_events.AllBlocksCleared(),
    ]
    message = decode_message(frames(sim_events.encode_batch(events, layout, dp_rank=2, ts=123.5)))
    assert (message.topic, message.seq) == ("kv@127.0.0.1:8000@m", 7)
    assert (message.batch.ts, message.batch.data_parallel_rank, message.batch.skipped) == (123.5, 2, 0)
    stored, offloaded, removed, cleared = message.batch.events
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size) == (
        [11, 12], None, list(range(32)), 16)
    assert (stored.medium, stored.lora_id, stored.lora_name) == ("GPU", 3, "ad")
    assert (offloaded.block_hashes, offloaded.token_ids, offloaded.medium) == ([12], [], "CPU")
    assert removed == BlockRemoved([11], "GPU", 0 if layout == "map" else None)
    assert isinstance(cleared, AllBlocksCleared)
    if layout == "map":
        assert (stored.extra_keys, stored.group_idx, stored.kv_cache_spec_kind) == ([None, None], 0, "full_attention")


def test_bytes_hashes_become_their_last_8_bytes_big_endian():
    engine_hash = bytes(range(24)) + (0x0102030405060708).to_bytes(8, "big")
    parent = b"\xff" * 24 + (42).to_bytes(8, "big")
    payload = packed([1.0, [["BlockStored", [engine_hash], parent, [5] * 16, 16]], 0])
    (event,) = decode_payload(payload).events
    assert event.block_hashes == [0x0102030405060708]
    assert event.parent_block_hash == 42
    assert block_hash_to_int(2**70) == 2**70  # ints are kept as sent


def test_positional_events_missing_trailing_fields_take_defaults():
    payload = packed([2.0, [["BlockStored", [1, 2], None, [0] * 32, 16], ["BlockRemoved", [1]]]])
    batch = decode_payload(payload)
    stored, removed = batch.events
    assert (stored.medium, stored.lora_id, stored.lora_name, stored.extra_keys) == (None, None, None, None)
    assert (removed.block_hashes, removed.medium) == ([1], None)
    assert batch.data_parallel_rank is None  # a two-field batch


def test_extra_trailing_and_unknown_fields_are_ignored():
    positional = ["BlockStored", [1], None, [0] * 16, 16, None, "CPU", None, [None], 0, "full_attention", None,
                  "a-future-field"]
    mapped = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0, "new_field": [1, 2]}
    stored, removed = decode_payload(packed([3.0, [positional, mapped], 0])).events
    assert (stored.medium, stored.kv_cache_spec_kind) == ("CPU", "full_attention")
    assert removed == BlockRemoved([1], "GPU", 0)


def test_a_map_shaped_batch_is_accepted():
    payload = packed({"ts": 4.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1})
    batch = decode_payload(payload)
    assert batch.data_parallel_rank == 1 and isinstance(batch.events[0], AllBlocksCleared)


def test_unknown_event_types_are_skipped_and_counted():
    payload = packed([5.0, [{"type": "BlockPinned", "x": 1}, ["SomethingNew", 1], ["BlockRemoved", [9], "GPU"]], 0])
    batch = decode_payload(payload)
    assert batch.skipped == 2
    assert batch.events == [BlockRemoved([9], "GPU")]


@pytest.mark.parametrize("message", [
    [b"topic", (1).to_bytes(8, "big")],  # two frames
    [b"topic", b"\x00\x01", packed([1.0, [], 0])],  # seq not 8 bytes
    [b"\xff\xfe", (1).to_bytes(8, "big"), packed([1.0, [], 0])],  # topic not UTF-8
    frames(b"\xc1 not msgpack"),
    frames(packed("a string")),
    frames(packed([1.0])),  # no events
    frames(packed(["yesterday", [], 0])),  # ts not a number
    frames(packed([1.0, {"not": "a list"}, 0])),
    frames(packed([1.0, [], "rank"])),
    frames(packed([1.0, [42], 0])),  # event neither map nor array
    frames(packed([1.0, [[]], 0])),  # empty positional event
    frames(packed([1.0, [{"block_hashes": [1]}], 0])),  # no type tag
    frames(packed([1.0, [["BlockStored", "hashes", None, [], 16]], 0])),
    frames(packed([1.0, [["BlockStored", [1.5], None, [], 16]], 0])),  # float hash
    frames(packed([1.0, [["BlockStored", [1], None, ["a"], 16]], 0])),  # token not an int
    frames(packed([1.0, [["BlockStored", [1], None, [1], "16"]], 0])),  # block_size not an int
    frames(packed([1.0, [["BlockRemoved", [1], 7]], 0])),  # medium not a string
])
def test_malformed_messages_raise_one_decode_error(message):
    with pytest.raises(KVEventDecodeError):
        decode_message(message)
